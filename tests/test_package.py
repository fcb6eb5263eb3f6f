"""The package import: ``import quack`` loads no kernel family (nor torch or the
CuTe DSL), a family loads neither torch._dynamo nor the DSL, and the lazy
exports stay the ops however the submodules are imported.

Each check runs in a fresh interpreter (on this process's import path), since
this process has imported the families already."""

import os
import subprocess
import sys
import textwrap


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
    assert "'quack.softmax'" in loaded
    for other in ("rmsnorm", "layernorm", "cross_entropy", "gemm"):
        assert f"'quack.{other}'" not in loaded


def test_no_family_imports_dynamo_or_the_dsl():
    # torch._dynamo and the CuTe DSL cost seconds of cold start (issue 19): torch.compile imports
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
        import quack.layernorm                  # the submodule first, then the export
        from quack import rmsnorm               # the export first, then the submodule
        import quack.rmsnorm
        from quack.softmax import softmax_bwd   # a from-import of the submodule
        import quack
        importlib.import_module("quack.gemm")
        for name in ("layernorm", "rmsnorm", "softmax", "gemm", "cross_entropy", "gemm_ref"):
            print(name, type(getattr(quack, name)).__name__)
        print(rmsnorm is quack.rmsnorm is importlib.import_module("quack.rmsnorm").rmsnorm)
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
