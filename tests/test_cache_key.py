"""The object key: what enters it, what must not, and the per-family source hash."""

import json
import platform
import shutil
import socket
import sys
import types
from pathlib import Path

import pytest
import torch

import quack.cache
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)
from quack.cache import key as keymod
from quack.cache.source_hash import package_source_hash

_FAKE_PACKAGE = {
    "__init__.py": "from . import rmsnorm, softmax\n",
    "rmsnorm.py": "from .base import Reduce\nfrom .cache import jit_cache\nimport math\n",
    "softmax.py": "import fakeq.util\n\ndef f():\n    from fakeq import lazy\n",
    "base.py": "from .deep import depth\nReduce = 1\n",
    "deep.py": "depth = 2\n",
    "util.py": "U = 1\n",
    "lazy.py": "L = 1\n",
    "cache/__init__.py": "jit_cache = None\n",
    "testing/plugin.py": "from .. import rmsnorm\n",
    "ops/__init__.py": "",
    "ops/norm.py": "from ..base import Reduce\n",
}


def _write_package(root: Path) -> Path:
    pkg = root / "fakeq"
    for rel, text in _FAKE_PACKAGE.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def _hashes(pkg: Path) -> dict[str, str]:
    return {fam: package_source_hash(pkg / f"{fam}.py", pkg, "fakeq") for fam in ("rmsnorm", "softmax")}


@pytest.mark.parametrize(
    "edited, changed",
    [
        ("softmax.py", {"softmax"}),
        ("rmsnorm.py", {"rmsnorm"}),
        ("base.py", {"rmsnorm"}),  # direct helper import
        ("deep.py", {"rmsnorm"}),  # transitive: rmsnorm -> base -> deep
        ("util.py", {"softmax"}),  # absolute `import fakeq.util`
        ("lazy.py", {"softmax"}),  # import inside a function
        ("cache/__init__.py", set()),  # the cache package is excluded
        ("testing/plugin.py", set()),  # so is the testing package
        ("__init__.py", set()),  # importing submodules does not pull in the package init
    ],
)
def test_editing_a_file_changes_only_the_families_that_import_it(tmp_path, edited, changed):
    pkg = _write_package(tmp_path)
    before = _hashes(pkg)
    with open(pkg / edited, "a") as f:
        f.write("# edited\n")
    after = _hashes(pkg)
    assert {fam for fam in before if before[fam] != after[fam]} == changed


def test_checkout_location_does_not_enter_the_source_hash(tmp_path):
    assert _hashes(_write_package(tmp_path / "a")) == _hashes(_write_package(tmp_path / "deeper" / "b"))


def test_fixture_family_hash_covers_its_helper(tmp_path):
    src = Path(__file__).parent / "cache_fixtures"
    copy = shutil.copytree(src, tmp_path / "cache_fixtures", ignore=shutil.ignore_patterns("__pycache__"))
    hash_of = lambda: package_source_hash(copy / "add_kernel.py", copy, "cache_fixtures")  # noqa: E731
    before = hash_of()
    assert hash_of() == package_source_hash(src / "add_kernel.py", src, "cache_fixtures")
    (copy / "env.py").write_text("# not imported by add_kernel\n")
    assert hash_of() == before
    (copy / "shapes.py").write_text("THREADS_PER_ROW = 32\n")
    assert hash_of() != before


def _key(**static):
    return keymod.object_key("fam", "cache_fixtures.add_kernel", "compile_add", static, quack.cache.current_arch())


def test_key_ignores_python_torch_host_and_checkout(monkeypatch, tmp_path, cache_env):
    reference = _key(n=64, dtype="float32")
    # What this machine would leak, read before anything is patched.
    real = (platform.python_version(), torch.__version__, socket.gethostname(), str(Path(__file__).parents[1]))
    monkeypatch.setattr(sys, "version", "9.9.9 (fake)")
    monkeypatch.setattr(sys, "version_info", (9, 9, 9, "final", 0))
    monkeypatch.setattr(platform, "python_version", lambda: "9.9.9")
    monkeypatch.setattr(torch, "__version__", "0.0.0+fake")
    monkeypatch.setattr(socket, "gethostname", lambda: "elsewhere")
    monkeypatch.chdir(tmp_path)
    patched = _key(n=64, dtype="float32")
    assert patched == reference
    for key in (reference, patched):
        text = keymod.canonical_json(key)
        # The patched values prove the key never asks; the real ones are
        # checked where they are long enough not to occur by chance ("vm" is
        # in "llvm").
        for leaked in (*(r for r in real if len(r) >= 4), "9.9.9", "0.0.0+fake", "elsewhere", str(tmp_path)):
            assert leaked not in text, leaked


def test_key_fields(cache_env):
    key = _key(n=64, dtype="float32", shape=(1, 2))
    assert set(key) == {
        "format", "family", "function", "source", "dsl_version", "cuda",
        "arch", "host_target", "options", "args",
    }  # fmt: skip
    assert key["format"] == quack.cache.CACHE_FORMAT_VERSION
    assert key["args"] == {"n": 64, "dtype": "float32", "shape": [1, 2]}
    assert key["dsl_version"] == "4.8.1"
    assert len(keymod.key_hash(key)) == 32


def test_arch_and_options_enter_the_key(monkeypatch, cache_env):
    default = _key(n=64)
    assert default["arch"] == "sm_90a"
    monkeypatch.setenv("QUACK_ARCH", "sm_100a")
    other = _key(n=64)
    assert other["options"] == "--gpu-arch sm_100a --host-target 'llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=x86-64'"
    assert quack.cache.compile_options() == other["options"]
    assert keymod.key_hash(default) != keymod.key_hash(other)
    assert keymod.key_hash(_key(n=64)) != keymod.key_hash(_key(n=128))


@pytest.mark.parametrize("capability, arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((8, 0), "sm_80")])
def test_arch_from_visible_gpu(monkeypatch, capability, arch):
    monkeypatch.delenv("QUACK_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    assert quack.cache.current_arch() == arch


def test_cuda_flavour_follows_the_loaded_runtime_not_installed_packages(monkeypatch):
    import cutlass.runtime

    keymod.cuda_flavour.cache_clear()
    try:
        loaded = cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=False)
        assert keymod.cuda_flavour() in Path(loaded[0]).parts
        keymod.cuda_flavour.cache_clear()
        # Both flavours installed: the path of the library the DSL selects decides.
        monkeypatch.setattr(keymod, "_only_installed_flavour", lambda: None)
        fake = "/x/site-packages/nvidia_cutlass_dsl/cu99/lib/libcute_dsl_runtime.so"
        monkeypatch.setattr(cutlass.runtime, "find_runtime_libraries", lambda **kw: [fake])
        assert keymod.cuda_flavour() == "cu99"
    finally:
        keymod.cuda_flavour.cache_clear()


def test_non_static_arguments_are_rejected(cache_env):
    with pytest.raises(TypeError, match="'dtype'"):
        _key(dtype=torch.float16)


def test_function_prefix_is_unique_per_key():
    assert keymod.function_prefix("rms-norm", "ab" * 16) == "quack_rms_norm_" + "ab" * 8
    assert keymod.function_prefix("f", "1" * 32) != keymod.function_prefix("f", "2" * 32)


def test_key_is_json_roundtrip_stable(cache_env):
    key = _key(n=64, t=(1.5, None, True))
    assert json.loads(json.dumps(key)) == key


def test_symlinked_checkout_hashes_like_the_real_one(tmp_path, monkeypatch):
    """Bazel runfiles: every file a symlink into the source tree, same key."""
    from quack.cache.source_hash import module_source_hash

    real = _write_package(tmp_path / "real")
    runfiles = tmp_path / "runfiles" / "fakeq"
    for path in real.rglob("*.py"):
        link = runfiles / path.relative_to(real)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
    hashes = []
    for root in (real.parent, runfiles.parent):
        monkeypatch.syspath_prepend(str(root))
        for name in [m for m in sys.modules if m == "fakeq" or m.startswith("fakeq.")]:
            monkeypatch.delitem(sys.modules, name)
        module_source_hash.cache_clear()
        hashes.append(module_source_hash("fakeq.ops.norm"))
    module_source_hash.cache_clear()
    assert hashes[0] == hashes[1] == package_source_hash(real / "ops" / "norm.py", real, "fakeq")


def test_source_hash_is_taken_when_the_family_is_imported(tmp_path, monkeypatch, cache_env):
    """An edit after import must not export the imported (old) code under the
    new code's key: the key keeps the hash of the sources as imported."""
    import importlib

    from quack.cache.source_hash import module_source_hash

    src = Path(__file__).parent / "cache_fixtures"
    shutil.copytree(src, tmp_path / "fixtures_as_imported", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("fixtures_as_imported.add_kernel")
    try:
        key = lambda: keymod.object_key("fam", module.__name__, "compile_add", {"n": 64}, "sm_90a")  # noqa: E731
        imported = key()["source"]
        (tmp_path / "fixtures_as_imported" / "shapes.py").write_text("THREADS_PER_ROW = 64\n")
        module_source_hash.cache_clear()
        quack.cache.clear()
        assert module_source_hash(module.__name__) != imported  # the disk has changed...
        assert key()["source"] == imported  # ...the key still names the code that runs
    finally:
        module_source_hash.cache_clear()
        for name in [m for m in sys.modules if m.startswith("fixtures_as_imported")]:
            monkeypatch.delitem(sys.modules, name)


def test_dsl_code_generation_settings_enter_the_key(monkeypatch, cache_env):
    # CUTE_DSL_LINEINFO changes the generated code (the DSL marks it
    # affects_compile); CUTE_DSL_LOG_LEVEL does not.  None set: no field, so
    # default builds keep their keys.
    assert "dsl_settings" not in _key(n=64)
    plain = keymod.key_hash(_key(n=64))
    monkeypatch.setenv("CUTE_DSL_LOG_LEVEL", "10")
    assert keymod.key_hash(_key(n=64)) == plain
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert _key(n=64)["dsl_settings"] == {"CUTE_DSL_LINEINFO": "1"}
    assert keymod.key_hash(_key(n=64)) != plain


def test_an_object_built_with_a_dsl_setting_never_loads_without_it(monkeypatch, cache_env):
    from cache_fixtures.add_kernel import compile_add

    from quack.compile_only import compile_only_mode

    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    with compile_only_mode():
        compile_add(48)
    assert len(list(cache_env.writable.rglob("*.o"))) == 1
    monkeypatch.delenv("CUTE_DSL_LINEINFO")
    monkeypatch.setenv("QUACK_CACHE_STRICT", "1")
    quack.cache.clear()
    with compile_only_mode(), pytest.raises(quack.cache.CacheMissError):
        compile_add(48)


def test_the_dsl_version_as_its_package_writes_it():
    """The device kit has no wheel metadata: the version is read from the
    package's source without importing it, and is what the package says."""
    import cutlass

    assert keymod._written_version() == cutlass.__version__


def test_the_only_installed_flavour_needs_no_dsl_import(tmp_path, monkeypatch):
    base = tmp_path / "nvidia_cutlass_dsl"
    package = base / "dsl_packages" / "cutlass" / "__init__.py"
    package.parent.mkdir(parents=True)
    package.write_text('__version__ = "0"\n')
    (base / "cu13" / "lib").mkdir(parents=True)
    (base / "cu13" / "lib" / "libcute_dsl_runtime.so").write_bytes(b"")
    real = keymod.importlib.util.find_spec
    spec = types.SimpleNamespace(origin=str(package))
    monkeypatch.setattr(keymod.importlib.util, "find_spec", lambda name: spec if name == "cutlass" else real(name))
    monkeypatch.delenv("CUTE_DSL_LIBS", raising=False)
    assert keymod.dsl_root() == base  # where the DSL's own search finds its libraries
    assert keymod._only_installed_flavour() == "cu13"
    monkeypatch.setenv("CUTE_DSL_LIBS", "/elsewhere/libcute_dsl_runtime.so")
    assert keymod._only_installed_flavour() is None  # the DSL's choice: ask it
    monkeypatch.delenv("CUTE_DSL_LIBS")
    (base / "cu12" / "lib").mkdir(parents=True)
    (base / "cu12" / "lib" / "libcute_dsl_runtime.so").write_bytes(b"")
    assert keymod._only_installed_flavour() is None  # two to choose from: ask the DSL


def test_the_loader_takes_the_runtime_the_key_names(monkeypatch):
    """quack/cache/native.py loads objects with the runtime library of the
    flavour their key names (both flavours are installed here)."""
    from quack.cache import native

    native.runtime_library_path.cache_clear()
    monkeypatch.delenv("CUTE_DSL_LIBS", raising=False)
    path = native.runtime_library_path()
    native.runtime_library_path.cache_clear()
    assert path is not None and path.parts[-3] == keymod.cuda_flavour()
