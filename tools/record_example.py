"""Record and replay, end to end: every op called at shapes no test warms.

    QUACK_CACHE_RECORD=calls.jsonl python tools/record_example.py        # GPU, compiles 8 kernels
    python tools/warm_cache.py --out=DIR --configs=calls.jsonl          # any machine, no GPU
    QUACK_CACHE_PATH=DIR QUACK_CACHE_STRICT=1 python tools/record_example.py --expect-no-compile

tools/configs/recorded_h200.jsonl is this script's recording on the H200, part of
//quack:warm_cache: against the Bazel artifact the third command compiles nothing.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import quack  # noqa: E402
from quack import cache  # noqa: E402

torch.manual_seed(0)
bf, fp16 = torch.bfloat16, torch.float16
out = []
x = torch.randn(3, 3000, device="cuda", dtype=bf, requires_grad=True)
w = torch.nn.Parameter(torch.ones(3000, device="cuda"))
y = quack.rmsnorm(x, w); y.float().pow(2).sum().backward(); out += [y, x.grad, w.grad]
with torch.no_grad():
    out.append(quack.layernorm(torch.randn(5, 1536, device="cuda", dtype=bf), w[:1536].detach().clone().to(bf)))
s = torch.randn(7, 12288, device="cuda", dtype=fp16, requires_grad=True)
p = quack.softmax(s); (p.float() * torch.randn_like(p.float())).sum().backward(); out += [p, s.grad]
logits = torch.randn(9, 50257, device="cuda", dtype=bf, requires_grad=True)
loss = quack.cross_entropy(logits, torch.randint(0, 50257, (9,), device="cuda")); loss.backward(); out += [loss, logits.grad]
out.append(quack.gemm(torch.randn(1000, 2048, device="cuda", dtype=fp16), torch.randn(2048, 1536, device="cuda", dtype=fp16)))
print("checksum", sum(float(t.float().abs().sum()) for t in out))
print("stats", cache.stats())
if "--expect-no-compile" in sys.argv:
    if cache.stats()["compiles"]:
        sys.exit(f"compiled {cache.stats()['compiles']} kernels, expected none")
    print("zero compiles")
