"""Threads and processes at once (no GPU): compiles serialised across threads while lookups and
loads stay concurrent, and a bounded stress run of processes compiling, loading, pruning,
verifying, installing and recording in one layer beside a user's own files."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import quack.cache
from cache_fixtures import fake_kernel
from cache_fixtures.env import cache_env  # noqa: F401  (fixture)
from cache_fixtures.fake_kernel import FAMILY, compile_fake
from quack.cache import cli, maintenance, native, store

REPO = Path(__file__).resolve().parents[1]

# Twelve real kernels, four threads at a time, half of them in compile-only mode: the DSL's
# compiler is not thread-safe, so without the process-wide lock this crashes or corrupts.
_COMPILE_THREADS = textwrap.dedent(
    """
    import os, sys, threading
    sys.path[:0] = [os.environ["REPO"], os.path.join(os.environ["REPO"], "tests")]
    from cache_fixtures.add_kernel import compile_add
    from quack.compile_only import compile_only_mode
    errors = []

    def work(n, dtype, warm):
        try:
            if warm:
                with compile_only_mode():
                    compile_add(n, dtype)
            else:
                assert compile_add(n, dtype) is not None
        except BaseException as exc:
            errors.append(f"{n} {dtype}: {type(exc).__name__}: {exc}")

    for round in range(3):
        threads = [threading.Thread(target=work, args=(32 * (4 * round + i + 1), ("float32", "float16")[i % 2], i < 2))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print("errors:", errors)
    """
)


def test_threads_compiling_different_kernels_at_once(cache_env):
    env = dict(os.environ, REPO=str(REPO))
    done = subprocess.run([sys.executable, "-c", _COMPILE_THREADS], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "errors: []" in done.stdout, done.stdout[-3000:]
    layer = store.Layer(cache_env.writable, "writable", True)
    entries = maintenance.scan(layer)
    assert len(entries) == 12 and all(maintenance.check(e) == "" for e in entries)


def test_lookups_and_loads_do_not_wait_for_a_compile(cache_env, monkeypatch):
    """A thread compiling (holding the DSL lock) does not hold up another
    thread's memory hits and loads from disk."""
    fake_kernel.use_fakes(monkeypatch)
    compile_fake(1)
    quack.cache.clear()
    compiling, finish = threading.Event(), threading.Event()

    def long_compile():
        with native.DSL_LOCK:
            compiling.set()
            finish.wait(30)

    thread = threading.Thread(target=long_compile)
    thread.start()
    try:
        compiling.wait(10)
        start = time.monotonic()
        compile_fake(1)  # from disk
        compile_fake(1)  # from memory
        assert time.monotonic() - start < 5
        assert quack.cache.stats()["hits"] == {"writable": 1, "memory": 1}
    finally:
        finish.set()
        thread.join()


# --- the stress run -------------------------------------------------------------------------------

_WORKER = fake_kernel.WORKER_PRELUDE + textwrap.dedent(
    """
    import json, random, threading, time
    from cache_fixtures.fake_kernel import compile_fake, LOADS
    deadline = time.monotonic() + float(os.environ["SECONDS"])
    counts = {"calls": 0, "errors": []}

    def hammer(seed):
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            try:
                compile_fake(rng.randrange(24))
                counts["calls"] += 1
            except Exception as exc:
                counts["errors"].append(f"{type(exc).__name__}: {exc}")
            if rng.random() < 0.2:
                quack.cache.clear()  # back to disk

    threads = [threading.Thread(target=hammer, args=(os.getpid() * 10 + i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"calls": counts["calls"], "errors": counts["errors"][:5], "loads": len(LOADS),
                      "wrong_loads": sum(not ok for _, ok in LOADS)}))
    """
)

_MAINTAINER = fake_kernel.WORKER_PRELUDE + textwrap.dedent(
    """
    import io, json, time
    from pathlib import Path
    from quack.cache import cli, maintenance, store
    layer = store.Layer(Path(os.environ["QUACK_CACHE_DIR"]), "writable", True)
    deadline = time.monotonic() + float(os.environ["SECONDS"])
    job, bundle = os.environ["JOB"], os.environ.get("BUNDLE", "")
    rounds = removed = failures = 0
    while time.monotonic() < deadline:
        out = io.StringIO()
        if job == "prune":
            removed += len(maintenance.prune(layer, 40 * 1024)[0])
        elif job == "verify":
            failures += cli.main(["verify", "--json"], out=out) not in (0, 1)
        else:
            failures += cli.main(["install", bundle, "--json"], out=out) != 0
        rounds += 1
    print(json.dumps({"rounds": rounds, "removed": removed, "failures": failures}))
    """
)

_REAL_COMPILES = textwrap.dedent(
    """
    import os, sys, threading, json
    sys.path[:0] = [os.environ["REPO"], os.path.join(os.environ["REPO"], "tests")]
    from cache_fixtures.add_kernel import compile_add
    errors = []

    def work(ns):
        for n in ns:
            try:
                compile_add(n)
            except BaseException as exc:
                errors.append(f"{n}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=([32 * (2 * i + 1), 32 * (2 * i + 2)],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"calls": 6, "errors": errors}))
    """
)


_RECORDER = textwrap.dedent(
    """
    import json, os, random, sys, threading, time
    sys.path[:0] = [os.environ["REPO"]]
    from quack.calls import manifest, plan, recording
    signatures = manifest.read(os.path.join(os.environ["REPO"], "tools", "configs", "production.jsonl"))
    deadline = time.monotonic() + float(os.environ["SECONDS"])
    counts = {"calls": 0, "errors": []}

    def record(seed):
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            try:
                recording.record(rng.choice(signatures), plan.entry_line)
                counts["calls"] += 1
            except Exception as exc:
                counts["errors"].append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=record, args=(os.getpid() * 10 + i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"calls": counts["calls"], "errors": counts["errors"][:5], "distinct": len(signatures)}))
    """
)


def _foreign_files(root: Path) -> dict[str, bytes]:
    files = {"notes.txt": b"mine", "poetry.lock": b"lock", "Documents/a.o": b"not a kernel",
             f"{FAMILY}/README": b"kept"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        (root / name).write_bytes(data)
    return files


def test_stress_threads_and_processes_on_one_layer(cache_env, capsys):
    cache_env.writable.mkdir(mode=0o700)
    foreign = _foreign_files(cache_env.writable)
    # A bundle of eight of the keys the workers ask for, installed over and over.
    source = cache_env.tmp / "source"
    env = dict(os.environ, REPO=str(REPO), QUACK_ARCH="sm_90a", SECONDS="6", QUACK_CACHE_DIR=str(source))
    for name in ("QUACK_CACHE_PATH", "QUACK_CACHE_STRICT", "QUACK_CACHE_MAX_SIZE"):
        env.pop(name, None)
    subprocess.run([sys.executable, "-c", fake_kernel.WORKER_PRELUDE
                    + "from cache_fixtures.fake_kernel import compile_fake\n[compile_fake(n) for n in range(8)]"],
                   env=env, check=True, timeout=60)
    bundle = cache_env.tmp / "eight.tar"
    assert cli.main(["bundle", "--out", str(bundle), str(source)]) == 0
    env["QUACK_CACHE_DIR"] = str(cache_env.writable)

    def start(script, **extra):
        return subprocess.Popen([sys.executable, "-c", script], env=dict(env, **extra), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    workers = [start(_WORKER, **({"QUACK_CACHE_MAX_SIZE": "48K"} if i == 0 else {})) for i in range(4)]
    record = cache_env.tmp / "calls.jsonl"
    others = [start(_MAINTAINER, JOB="prune"), start(_MAINTAINER, JOB="verify"),
              start(_MAINTAINER, JOB="install", BUNDLE=str(bundle)), start(_REAL_COMPILES),
              start(_RECORDER, QUACK_CACHE_RECORD=str(record)), start(_RECORDER, QUACK_CACHE_RECORD=str(record))]
    results, crashes = [], []
    for proc in workers + others:
        out, err = proc.communicate(timeout=240)
        if proc.returncode != 0 or "Traceback" in err:
            crashes.append(err[-2000:])
            continue
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert not crashes, crashes
    hammers, (pruner, verifier, installer, compiler, *recorders) = results[:4], results[4:]
    calls = sum(r["calls"] for r in hammers) + compiler["calls"]
    wrong = sum(r["wrong_loads"] for r in hammers)
    errors = [e for r in hammers + recorders for e in r["errors"]] + compiler["errors"]
    from quack.calls import manifest

    recorded = manifest.read(record)  # whole lines only, each signature once across both processes
    assert len(recorded) == len(set(recorded)) == recorders[0]["distinct"]
    lost = [n for n, data in foreign.items()
            if not (cache_env.writable / n).is_file() or (cache_env.writable / n).read_bytes() != data]
    layer = store.Layer(cache_env.writable, "writable", True)
    left = maintenance.scan(layer)
    with capsys.disabled():
        print(f"\nstress: {calls} lookups ({sum(r['loads'] for r in hammers)} loads from disk, 6 real compiles "
              f"in 3 threads), {pruner['rounds']} prunes removing {pruner['removed']} entries, "
              f"{verifier['rounds']} verifies, {installer['rounds']} installs, "
              f"{sum(r['calls'] for r in recorders)} record calls in 2 processes; crashes {len(crashes)}, "
              f"errors {len(errors)}, wrong loads {wrong}, lost files {len(lost)}")
    assert not errors and wrong == 0 and not lost
    assert pruner["removed"] > 0 and installer["rounds"] > 0 and installer["failures"] == 0
    assert verifier["failures"] == 0
    problems = {f"{e.family}/{e.keyhash}": maintenance.check(e) for e in left}
    assert not any(problems.values()), {name: why for name, why in problems.items() if why}
    assert [p.name for p in cache_env.writable.rglob("*.lock")] == ["poetry.lock"]  # no key lock left
    assert not [p for p in (cache_env.writable / FAMILY).iterdir() if p.name.startswith(".")]
