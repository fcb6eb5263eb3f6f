"""Repository-wide pytest setup: the quack plugin (``--compile-only``, the ``gpu`` marker)."""

pytest_plugins = ["quack.testing.pytest_plugin"]
