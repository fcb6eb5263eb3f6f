"""quack: Hopper kernels in the CuTe DSL whose compiled objects are cached build artifacts.

Public ops: :func:`rmsnorm`, :func:`softmax`, :func:`cross_entropy`,
:func:`layernorm`, :func:`gemm`, :func:`gemm_glu`, :func:`mlp`.  The kernel cache is :mod:`quack.cache`;
compile-only warming is :mod:`quack.compile_only` and the pytest plugin
``quack.testing.pytest_plugin``.

The exports are bound on first use: ``import quack`` imports no kernel family
(nor torch or the CuTe DSL), and a process that uses one family imports that
family's modules only -- what lets a Bazel action declare exactly the modules
it reads.

Another distribution that installs a top-level ``quack`` (QuACK's
``quack-kernels``) cannot share an environment with this one: importing
``quack`` then raises ``ImportError`` naming both, rather than running a mix of
the two packages' modules.
"""

import importlib
import os
import sys
import types

# Written once: pyproject.toml reads it (setuptools' attr:, without importing the package).
__version__ = "0.1.0"

DISTRIBUTION = "quack-kernels-cached"

# Distributions that install a top-level ``quack`` package of their own.
_CLASHING_DISTRIBUTIONS = ("quack-kernels",)

# Each export -> the submodule defining it.
_EXPORTS = {
    "cross_entropy": "families.cross_entropy",
    "cross_entropy_ref": "families.cross_entropy",
    "gemm": "families.gemm",
    "gemm_glu": "families.gemm",
    "gemm_ref": "families.gemm",
    "layernorm": "families.layernorm",
    "layernorm_ref": "families.layernorm",
    "mlp": "families.gemm",
    "rmsnorm": "families.rmsnorm",
    "rmsnorm_ref": "families.rmsnorm",
    "softmax": "families.softmax",
    "softmax_ref": "families.softmax",
}

__all__ = sorted(_EXPORTS)


class _Package(types.ModuleType):
    """The package's module type: binds exports on first access."""

    def __getattr__(self, name):
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'quack' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"quack.{module}"), name)
        super().__setattr__(name, value)
        return value


    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_EXPORTS))


def _normalized(name: str) -> str:
    """A distribution name as its metadata folder spells it (PEP 503, ``-`` as ``_``)."""
    return name.lower().replace("-", "_").replace(".", "_")


def _clashing_metadata() -> list[str]:
    """Metadata folders (``*.dist-info``, ``*.egg-info``) on ``sys.path`` of a
    distribution in ``_CLASHING_DISTRIBUTIONS``.

    Lists the path's folders by name only (a quarter of a millisecond):
    ``importlib.metadata`` costs 20 ms to import, so it is imported only once
    such a folder is found (see ``_check_no_other_owner``).
    """
    wanted = {_normalized(name) for name in _CLASHING_DISTRIBUTIONS}
    stdlib = os.path.dirname(os.__file__)  # it and its lib-dynload hold no installed distribution
    found = []
    for entry in sys.path:
        if entry in (stdlib, os.path.join(stdlib, "lib-dynload")):
            continue
        try:
            names = os.listdir(entry or ".")
        except OSError:  # a zip file, a missing folder
            continue
        for name in names:
            if name.endswith((".dist-info", ".egg-info")) and _normalized(name.split("-")[0].split(".")[0]) in wanted:
                found.append(os.path.join(entry or ".", name))
    return found


def _check_no_other_owner() -> None:
    """Raise ``ImportError`` if another installed distribution owns a top-level ``quack``."""
    folders = _clashing_metadata()
    if not folders:
        return
    from importlib import metadata
    from pathlib import Path

    for folder in folders:
        other = metadata.PathDistribution(Path(folder))
        top_level = (other.read_text("top_level.txt") or "").split()
        # RECORD as written (``Distribution.files`` leaves out files missing on disk since Python 3.12).
        recorded = [line.split(",", 1)[0] for line in (other.read_text("RECORD") or "").splitlines()]
        if "quack" not in top_level and not any(path.split("/", 1)[0] == "quack" for path in recorded):
            continue
        name, version = other.metadata["Name"], other.version
        raise ImportError(
            f"two installed distributions provide the Python package 'quack': {DISTRIBUTION} "
            f"{__version__} (this one, {os.path.dirname(__file__)}) and {name} {version} "
            f"(metadata in {folder}): each overwrites or shadows the other's modules. Uninstall one "
            f"(pip uninstall {name}, or pip uninstall {DISTRIBUTION}), or install them in "
            "separate virtual environments."
        )


_check_no_other_owner()
sys.modules[__name__].__class__ = _Package
