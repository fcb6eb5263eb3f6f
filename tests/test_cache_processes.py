"""Cross-process invariants: racing processes compile once; objects are byte-identical
across fresh processes and across checkouts in different folders."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from quack.cache.store import Layer, verify_entry

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "cache_fixtures"

# Each worker waits at a file barrier until all have imported cutlass, then asks
# for the same cold key at once and reports what it got.
_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import quack.cache
    from quack.compile_only import compile_only_mode
    from cache_fixtures.add_kernel import compile_add

    barrier, parties = Path(os.environ["BARRIER"]), int(os.environ["PARTIES"])
    (barrier / str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while len(list(barrier.iterdir())) < parties:
        if time.monotonic() > deadline:
            sys.exit("the other workers never arrived: the processes did not race")
        time.sleep(0.01)
    if os.environ.get("COMPILE_ONLY"):
        with compile_only_mode():
            compile_add(40)
        handle = None
    else:
        handle = compile_add(40)
    print(json.dumps({"fn": type(getattr(handle, "_fn", None)).__name__,
                      "keyhash": getattr(handle, "keyhash", None),
                      "stats": quack.cache.stats()}))
    """
)


def _env(tmp, checkout, cache_dir, parties=1, **extra):
    env = dict(os.environ)
    env.update(
        # The parent's path last: on the GPU machine the CuTe DSL is only found through it.
        PYTHONPATH=os.pathsep.join(filter(None, [str(checkout), str(REPO), os.environ.get("PYTHONPATH")])),
        QUACK_CACHE_DIR=str(cache_dir),
        QUACK_TEST_COMPILE_LOG=str(tmp / "compiles.log"),
        BARRIER=str(tmp / f"barrier-{cache_dir.name}"),
        PARTIES=str(parties),
        CUTE_DSL_DISABLE_FILE_CACHING="1",  # really compile; no DSL-level IR cache
        **extra,
    )
    for name in ("QUACK_CACHE_PATH", "QUACK_CACHE_STRICT", "QUACK_ARCH", "QUACK_CACHE_MAX_SIZE"):
        env.pop(name, None)
    Path(env["BARRIER"]).mkdir(exist_ok=True)
    return env


def _run_workers(env, count):
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_racing_processes_compile_once(tmp_path):
    cache = tmp_path / "cache"
    results = _run_workers(_env(tmp_path, FIXTURES.parent, cache, parties=8), 8)
    assert len((tmp_path / "compiles.log").read_text().splitlines()) == 1
    assert sum(r["stats"]["compiles"] for r in results) == 1
    assert sum(r["stats"]["hits"].get("writable", 0) for r in results) == 7
    assert {r["fn"] for r in results} == {"FastLauncher"}
    [keyhash] = {r["keyhash"] for r in results}
    [sidecar] = (cache / "test_add").glob("*.json")
    key = json.loads(sidecar.read_text())["key"]
    assert verify_entry(Layer(cache, "writable", True), "test_add", keyhash, key).state == "ok"
    assert not [p for p in (cache / "test_add").iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_objects_are_byte_identical_across_processes_and_checkouts(tmp_path):
    objects = []
    for name in ("a", "b"):
        checkout = tmp_path / name / "deeper" / "checkout"
        shutil.copytree(FIXTURES, checkout / "cache_fixtures", ignore=shutil.ignore_patterns("__pycache__"))
        cache = tmp_path / f"cache-{name}"
        _run_workers(_env(tmp_path, checkout, cache, COMPILE_ONLY="1"), 1)
        objects.append({p.name: p.read_bytes() for p in (cache / "test_add").glob("*.[oj]*")})
    assert len((tmp_path / "compiles.log").read_text().splitlines()) == 2
    assert objects[0] == objects[1] and len(objects[0]) == 2
