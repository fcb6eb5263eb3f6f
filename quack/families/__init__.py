"""The kernel families, one package each: its device code and its host code side by side.

A family's name is its package's name, its manifest op and its cache folder;
Bazel builds one cache action per package here (quack/BUILD.bazel).
"""
