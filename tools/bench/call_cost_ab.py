"""Two checkouts' call cost, paired: which is cheaper per eager call, beyond the host's drift.

    python tools/bench/call_cost_ab.py A_TREE B_TREE [--a-cache PATH] [--b-cache PATH]
        [--rounds 30] [--calls 2000] [--cpu 3] [--gemm-k 4096] [--gemm-m 16]

A GPU machine's host speeds up and slows down by a third within minutes, so
two runs of ``launch_overhead.py`` one after the other cannot tell 2% apart.
Here one worker process per checkout (its own ``quack`` on ``sys.path``, its
own ``QUACK_CACHE_PATH``) builds the calls of this checkout's
``launch_overhead.op_pairs()`` (public ops only, so both trees run the same
calls; ``--gemm-m`` and ``--gemm-k`` set the GEMM row's M and K) on its own
``quack`` and waits; both are pinned to the same CPU and take turns, op by op,
round by round (the order flips each round), so each pair of measurements
is milliseconds apart.  Each cell is ``per_call_us`` (calls timed in batches
on the CPU clock, the GPU synchronized between batches).

The table, per op: the medians of each tree's quack and torch per-call time,
and the median (with the quartiles) of the per-round ratio B/A of quack's
time.  Torch's own ratio B/A is the control: the same torch in both
workers, so it shows what the pairing leaves of the host's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# Runs in each worker: its tree's quack imported first (launch_overhead, from
# this checkout, puts its own repository on sys.path), then one JSON line per request.
WORKER = r"""
import json, os, sys
tree, bench, gemm_k, gemm_m = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, tree)
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # anything else printed goes to stderr, not into the replies
import quack
assert os.path.realpath(os.path.join(os.path.dirname(quack.__file__), "..")) == os.path.realpath(tree), quack.__file__
sys.path.insert(0, bench)
import launch_overhead as lo
pairs = lo.op_pairs(gemm_k, gemm_m)
for _, fast, ref in pairs:
    fast(), ref()
print(json.dumps([label for label, _, _ in pairs]), file=replies, flush=True)
for line in sys.stdin:
    index, calls = map(int, line.split())
    _, fast, ref = pairs[index]
    print(json.dumps([lo.per_call_us(fast, calls), lo.per_call_us(ref, calls)]), file=replies, flush=True)
"""


class Worker:
    """One checkout's measuring process."""

    def __init__(self, tree: str, cache: str | None, cpu: int | None, gemm_k: int, gemm_m: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
        if cache:
            env["QUACK_CACHE_PATH"] = cache
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, os.path.abspath(tree), os.path.dirname(os.path.abspath(__file__)),
             str(gemm_k), str(gemm_m)], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None)
        self.labels = json.loads(self._reply())

    def _reply(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker stopped (exit status {self.process.wait()}); its errors are above")
        return line

    def measure(self, index: int, calls: int) -> list[float]:
        self.process.stdin.write(f"{index} {calls}\n")
        self.process.stdin.flush()
        return json.loads(self._reply())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a_tree")
    parser.add_argument("b_tree")
    parser.add_argument("--a-cache", help="QUACK_CACHE_PATH of A's worker (default: the environment's)")
    parser.add_argument("--b-cache", help="QUACK_CACHE_PATH of B's worker (default: the environment's)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--cpu", type=int, default=None, help="the CPU both workers are pinned to")
    parser.add_argument("--gemm-k", type=int, default=4096,
                        help="the GEMM row's K (at 16 rows: 64 runs the small-M object unsplit, 4096 split)")
    parser.add_argument("--gemm-m", type=int, default=16,
                        help="the GEMM row's M (1024: the default object, the one every tree has)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (the table shows the ratios' quartiles)")

    a = Worker(args.a_tree, args.a_cache, args.cpu, args.gemm_k, args.gemm_m)
    b = Worker(args.b_tree, args.b_cache, args.cpu, args.gemm_k, args.gemm_m)
    labels = [label for label in a.labels if label in b.labels]
    cells = {label: {"a": [], "b": []} for label in labels}
    for round_index in range(args.rounds):
        for label in labels:
            order = (("a", a), ("b", b)) if round_index % 2 == 0 else (("b", b), ("a", a))
            for name, worker in order:
                cells[label][name].append(worker.measure(worker.labels.index(label), args.calls))
    a.close()
    b.close()

    print(f"A = {args.a_tree}, B = {args.b_tree}: {args.rounds} paired rounds of {args.calls} calls"
          f"{f', both on CPU {args.cpu}' if args.cpu is not None else ''}; us per call, medians")
    print("| op | quack A | quack B | quack B/A (q1-q3) | torch A | torch B | torch B/A (q1-q3) |")
    print("|---|---|---|---|---|---|---|")
    for label in labels:
        a_cells, b_cells = cells[label]["a"], cells[label]["b"]
        row = [label]
        for column in (0, 1):
            ratios = [bb[column] / aa[column] for aa, bb in zip(a_cells, b_cells)]
            q1, median, q3 = statistics.quantiles(ratios, n=4)
            row += [f"{statistics.median(c[column] for c in a_cells):.2f}",
                    f"{statistics.median(c[column] for c in b_cells):.2f}",
                    f"{median:.3f} ({q1:.3f}-{q3:.3f})"]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
