"""The package import: ``import quack`` loads no kernel family (nor torch or the
CuTe DSL), a family loads neither torch._dynamo nor the DSL, and the lazy
exports stay the ops however the submodules are imported; it refuses to run
beside another distribution of a top-level ``quack``. The release metadata:
one version, the licence, numpy and ``py.typed``.

Each check runs in a fresh interpreter (on this process's import path), since
this process has imported the families already."""

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest


def _python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_quack_loads_no_family_torch_or_dsl():
    loaded = _python("""
        import sys, quack
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("quack", "torch", "cutlass")))
    """)
    assert loaded == "['quack']"


def test_one_family_imports_that_family_only():
    loaded = _python("""
        import sys, quack
        quack.softmax
        print(sorted(m for m in sys.modules if m.startswith("quack.") and not m.startswith("quack.cache")))
    """)
    assert "'quack.families.softmax.op'" in loaded
    for other in ("rmsnorm", "layernorm", "cross_entropy", "gemm"):
        assert f"'quack.families.{other}'" not in loaded


def test_no_family_imports_dynamo_or_the_dsl():
    # torch._dynamo and the CuTe DSL cost seconds of cold start: torch.compile imports
    # the one when used, a compile the other; a process that loads cached objects needs neither.
    assert _python("""
        import sys, quack
        for name in ("rmsnorm", "layernorm", "softmax", "cross_entropy", "gemm"):
            getattr(quack, name)
        print("torch._dynamo" in sys.modules, "cutlass" in sys.modules)
    """) == "False False"


def test_exports_stay_the_ops_after_their_submodules_import():
    kinds = _python("""
        import importlib, types
        import quack.families.layernorm.op                  # the submodule first, then the export
        from quack import rmsnorm               # the export first, then the submodule
        import quack.families.rmsnorm.op
        from quack.families.softmax.op import softmax_bwd   # a from-import of the submodule
        import quack
        importlib.import_module("quack.families.gemm.op")
        for name in ("layernorm", "rmsnorm", "softmax", "gemm", "cross_entropy", "gemm_ref"):
            print(name, type(getattr(quack, name)).__name__)
        print(rmsnorm is quack.rmsnorm is importlib.import_module("quack.families.rmsnorm.op").rmsnorm)
    """).splitlines()
    assert kinds[:-1] == [f"{name} function" for name in
                          ("layernorm", "rmsnorm", "softmax", "gemm", "cross_entropy", "gemm_ref")]
    assert kinds[-1] == "True"


def test_an_unknown_name_is_an_attribute_error():
    assert _python("""
        import quack
        try:
            quack.no_such_op
        except AttributeError as e:
            print(e)
    """) == "module 'quack' has no attribute 'no_such_op'"


# Release metadata: one version, the licence, what an install ships. They read the checkout's
# files; where a test runs from the package alone (an installed copy), those tests skip.
REPO = Path(__file__).resolve().parents[1]


def _checkout_file(name: str) -> Path:
    path = REPO / name
    if not path.exists():
        pytest.skip(f"needs the checkout's {name}, not only the package")
    return path


def test_the_version_is_written_once_and_read_by_the_build():
    import quack

    project = tomllib.loads(_checkout_file("pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "quack.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", quack.__version__)


def test_module_bazel_names_the_package_version():
    import quack

    declared = re.search(r'module\(\s*name\s*=\s*"quack",\s*version\s*=\s*"([^"]+)"',
                         _checkout_file("MODULE.bazel").read_text())
    assert declared, "MODULE.bazel's module() names no version"
    assert declared[1] == quack.__version__


def test_the_cli_reports_the_version(capsys):
    import quack
    from quack.cache import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"quack-cache {quack.__version__} (quack-kernels-cached)\n"


def test_the_licence_is_bsd_3_clause_and_declared():
    licence = _checkout_file("LICENSE").read_text()
    assert licence.startswith("BSD 3-Clause License")
    assert "Copyright (c) 2026, the quack-kernels-cached authors" in licence
    project = tomllib.loads(_checkout_file("pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]


def test_the_install_declares_numpy_and_ships_py_typed():
    pyproject = tomllib.loads(_checkout_file("pyproject.toml").read_text())
    # torch's CPU wheel does not require numpy, and importing torch warns without it.
    assert "numpy" in pyproject["project"]["dependencies"]
    assert pyproject["tool"]["setuptools"]["package-data"]["quack"] == ["py.typed"]
    assert (REPO / "quack" / "py.typed").is_file()


# Another distribution owning a top-level `quack` (QuACK's quack-kernels): `import quack` refuses.
def _fake_distribution(site: Path, folder: str, files: dict[str, str]) -> None:
    (site / folder).mkdir(parents=True)
    for name, text in files.items():
        (site / folder / name).write_text(text)


def _import_quack_with(site: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(site)] + [p for p in sys.path if p])
    return subprocess.run([sys.executable, "-c", "import quack"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path), timeout=120)


QUACK_KERNELS_METADATA = "Metadata-Version: 2.1\nName: quack-kernels\nVersion: 0.2.1\n"


def test_import_refuses_when_quack_kernels_owns_quack_too(tmp_path):
    _fake_distribution(tmp_path, "quack_kernels-0.2.1.dist-info", {
        "METADATA": QUACK_KERNELS_METADATA,
        "RECORD": "quack/__init__.py,,\nquack/utils.py,,\nquack_kernels-0.2.1.dist-info/METADATA,,\n",
    })
    done = _import_quack_with(tmp_path)
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: two installed distributions provide the Python package 'quack'")
    assert "quack-kernels-cached" in message and "quack-kernels 0.2.1" in message
    assert "pip uninstall quack-kernels" in message and "separate virtual environments" in message


def test_import_refuses_an_egg_info_naming_quack_as_its_top_level(tmp_path):
    _fake_distribution(tmp_path, "quack_kernels.egg-info", {
        "PKG-INFO": QUACK_KERNELS_METADATA,
        "top_level.txt": "quack\n",
    })
    done = _import_quack_with(tmp_path)
    assert done.returncode != 0 and "quack-kernels 0.2.1" in done.stderr


def test_import_accepts_a_quack_kernels_that_owns_no_quack(tmp_path):
    _fake_distribution(tmp_path, "quack_kernels-0.2.1.dist-info", {
        "METADATA": QUACK_KERNELS_METADATA,
        "RECORD": "quack_kernels/__init__.py,,\n",
    })
    done = _import_quack_with(tmp_path)
    assert done.returncode == 0, done.stderr


def test_the_ownership_check_stays_cheap():
    # importlib.metadata costs 20 times the rest of `import quack`: without a clash it stays unloaded.
    assert _python("""
        import sys, quack
        print("importlib.metadata" in sys.modules)
    """) == "False"
