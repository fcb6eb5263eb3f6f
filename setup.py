"""The one compiled part of the package: the C launcher (quack/launch/_fastlaunch.c).

Everything else is declared in pyproject.toml.  The extension uses only the
stable ABI (abi3, Python 3.11 and later), so one build serves every
interpreter; it is optional: without a C compiler the install still succeeds
and kernels launch through ctypes (quack.launch.launcher says so once).
For a checkout used in place: ``python setup.py build_ext --inplace``.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "quack.launch._fastlaunch",
            ["quack/launch/_fastlaunch.c"],
            py_limited_api=True,
            optional=True,
            extra_compile_args=["-O2", "-std=c11"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
