"""GEMM: quack vs cuBLAS (torch.matmul) and torch's grouped GEMM, in TFLOP/s.

    python tools/bench/gemm.py [--plot gemm.png] [--only products|epilogues|backward|inference]

Dense bf16 (M, K) @ (K, N) with bf16 output; the backward's two products on
the same views autograd hands them (dA = dC @ Bᵀ, B's other layout, and
dB = Aᵀ @ dC, an M-contiguous A), against cuBLAS on those views; the
grouped (variable-length M) products of a mixture of experts: 8 groups of 2048 rows and
64 uneven groups summing to 32768 rows, K = N = 4096, forward, dA and dB
(the variable-length-K product); the fused activation and gated (gemm_glu)
epilogues against the plain GEMM and torch.  The grouped references are ``torch._grouped_mm``
(where this torch has it) and a loop of ``torch.matmul``.  Inputs are random
(zeros would flatter every GEMM: the tensor cores draw less power).  Each
figure is the median of three round-robin passes over the contenders.

``--only inference`` (not in the default run): bf16 A (M, K) @ B (K, N) at
the weight shapes of 7B to 70B models for M from 1 to 8192 against cuBLAS,
in us and in TB/s of operand traffic (A, B and C once each) with its share of
a device copy measured in the same run; then MoE decode steps (few tokens per
expert) against ``torch._grouped_mm`` and a loop of ``torch.matmul``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import quack  # noqa: E402
from harness import copy_bandwidth, interleaved_ms, parse_args, plot  # noqa: E402

DENSE = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 4096, 4096)]
BACKWARD = [(8192, 8192, 8192), (4096, 4096, 4096)]
# Inference: (K, N) weight shapes of common 7B to 70B models, and the token counts a step runs.
WEIGHTS = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
INFERENCE_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192]
# MoE decode: (experts, K, N), each expert getting 0 to 16 tokens.
MOE_DECODE = [(8, 4096, 14336), (64, 2048, 1408), (128, 4096, 1536)]


def _uneven_lengths(groups: int, total: int) -> list[int]:
    """Deterministic uneven group sizes (some empty) that sum to ``total``."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(groups, generator=gen) ** 2
    weights[::9] = 0
    lengths = (weights / weights.sum() * total).floor().to(torch.int64)
    lengths[-1] += total - int(lengths.sum())
    return lengths.tolist()


def _grouped_case(lengths, k, n, grad_a: bool = False):
    """The grouped product, or (``grad_a``) its dA = dC @ B[g]ᵀ on B's
    transposed view (column-major per group: no copy for either side)."""
    a = torch.randn(sum(lengths), k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(len(lengths), k, n, device="cuda", dtype=torch.bfloat16)
    if grad_a:
        b = torch.randn(len(lengths), n, k, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    cu = torch.nn.functional.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    bounds = cu.tolist()
    impls = {
        "quack": lambda: quack.gemm(a, b, cu_seqlens_m=cu),
        "torch._grouped_mm": None,
        "matmul loop": lambda: [a[bounds[g]:bounds[g + 1]] @ b[g] for g in range(len(lengths))],
    }
    if hasattr(torch, "_grouped_mm"):
        # Column-major per group, as cuBLASLt wants (dA's B view already is).
        b_cm = b if grad_a else b.transpose(1, 2).contiguous().transpose(1, 2)
        impls["torch._grouped_mm"] = lambda: torch._grouped_mm(a, b_cm, offs=cu[1:])
    return 2 * sum(lengths) * k * n, impls


def _grouped_db_case(lengths, k, n):
    """dB[g] = A[rows of g]ᵀ @ dC[rows of g]: the variable-length-K product,
    A's transposed view as it comes (M-contiguous), dC row-major."""
    a = torch.randn(sum(lengths), k, device="cuda", dtype=torch.bfloat16)
    dc = torch.randn(sum(lengths), n, device="cuda", dtype=torch.bfloat16)
    cu = torch.nn.functional.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    bounds = cu.tolist()
    impls = {
        "quack": lambda: quack.gemm(a.t(), dc, cu_seqlens_k=cu),
        "torch._grouped_mm": None,
        "matmul loop": lambda: [a[bounds[g]:bounds[g + 1]].t() @ dc[bounds[g]:bounds[g + 1]]
                                for g in range(len(lengths))],
    }
    if hasattr(torch, "_grouped_mm"):
        impls["torch._grouped_mm"] = lambda: torch._grouped_mm(a.t(), dc, offs=cu[1:])
    return 2 * sum(lengths) * k * n, impls


def cases():
    out = []
    for m, n, k in DENSE:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        out.append((f"dense {m}x{n}x{k}", 2 * m * n * k, {
            "quack": lambda a=a, b=b: quack.gemm(a, b),
            "cuBLAS": lambda a=a, b=b: a @ b,
        }))
    for m, n, k in BACKWARD:
        dc = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out.append((f"dA=dC@B^T {m}x{k}x{n}", 2 * m * n * k, {
            "quack": lambda dc=dc, b=b: quack.gemm(dc, b.t()),
            "cuBLAS": lambda dc=dc, b=b: dc @ b.t(),
        }))
        out.append((f"dB=A^T@dC {k}x{n}x{m}", 2 * m * n * k, {
            "quack": lambda a=a, dc=dc: quack.gemm(a.t(), dc),
            "cuBLAS": lambda a=a, dc=dc: a.t() @ dc,
        }))
    for label, lengths in (("grouped 8x2048", [2048] * 8), ("grouped 64 uneven", _uneven_lengths(64, 32768))):
        flops, impls = _grouped_case(lengths, 4096, 4096)
        out.append((f"{label} K=N=4096", flops, impls))
        flops, impls = _grouped_case(lengths, 4096, 4096, grad_a=True)
        out.append((f"{label} dA", flops, impls))
        flops, impls = _grouped_db_case(lengths, 4096, 4096)
        out.append((f"{label} dB (varlen K)", flops, impls))
    return out


# (activation, with a bias): the 5% budget's cases, and the bias alone and
# gelu_tanh alone, which tell the bias's share of an epilogue from the math's.
EPILOGUES = [("relu", False), (None, True), ("gelu_tanh", False), ("gelu_tanh", True), ("silu", True)]


def _epilogue_label(activation, with_bias: bool) -> str:
    return " + ".join(([activation] if activation else []) + (["bias"] if with_bias else []))


def _torch_activation(activation):
    from quack.families.gemm.epilogue import TORCH_ACTIVATIONS

    return TORCH_ACTIVATIONS[activation] if activation else (lambda z: z)


def _compiled(fn):
    """torch.compile of ``fn``; the cases share a few functions' code, each
    case its own guards, so the recompile limit is raised above the cases'
    count (at the default 8, the later cases ran torch's eager code)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn)


def epilogue_cases(size: int = 8192):
    """act(A @ B [+ bias]) at size^3 and at the grouped forward's shapes:
    fused in our epilogue, our plain GEMM (the 5% budget), torch's GEMM
    (torch.matmul, torch._grouped_mm) then the torch activation, and
    torch.compile of the same."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(size, device="cuda", dtype=torch.bfloat16)
    out = []
    for activation, with_bias in EPILOGUES:
        act, v = _torch_activation(activation), bias if with_bias else None

        def eager(act=act, v=v):
            z = a @ b
            return act(z + v if v is not None else z)

        label = f"{_epilogue_label(activation, with_bias)} {size}^3"
        out.append((label, 2 * size**3, {
            "quack fused": lambda activation=activation, v=v: quack.gemm(a, b, bias=v, activation=activation),
            "quack gemm only": lambda: quack.gemm(a, b),
            "torch": eager,
            "torch.compile": _compiled(eager),
        }))
    if hasattr(torch, "_grouped_mm"):
        out.extend(_grouped_epilogue_cases())
    return out


def _grouped_operands(lengths):
    """The grouped forward's x (sum(lengths), 4096), w (G, 4096, 4096), w in
    cuBLASLt's layout for torch._grouped_mm, and cu_seqlens."""
    x = torch.randn(sum(lengths), 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(lengths), 4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    w_cm = w.transpose(1, 2).contiguous().transpose(1, 2)
    cu = torch.nn.functional.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    return x, w, w_cm, cu


def _grouped_epilogue_cases():
    out = []
    for label, lengths in (("8x2048", [2048] * 8), ("64 uneven", _uneven_lengths(64, 32768))):
        x, w, w_cm, cu = _grouped_operands(lengths)
        bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        for activation, with_bias in EPILOGUES:
            act, v = _torch_activation(activation), bias if with_bias else None

            def grouped(x=x, w_cm=w_cm, cu=cu, act=act, v=v):
                z = torch._grouped_mm(x, w_cm, offs=cu[1:])
                return act(z + v if v is not None else z)

            name = f"{_epilogue_label(activation, with_bias)} grouped {label}"
            out.append((name, 2 * sum(lengths) * 4096 * 4096, {
                "quack fused": lambda x=x, w=w, cu=cu, v=v, activation=activation: quack.gemm(
                    x, w, cu_seqlens_m=cu, bias=v, activation=activation),
                "quack gemm only": lambda x=x, w=w, cu=cu: quack.gemm(x, w, cu_seqlens_m=cu),
                "torch": grouped,
                "torch.compile": _compiled(grouped),
            }))
    return out


def glu_cases(size: int = 8192):
    """act(A @ B_gate) * (A @ B_up) (``quack.gemm_glu``) with B of ``size``
    interleaved columns, at size^3 for each gated activation and at the
    grouped forward's shapes for swiglu: fused, our plain GEMM of the same
    B (the 5% budget), torch's GEMM then the torch gating, and torch.compile
    of the same.  FLOPs of the GEMM (2 M 2N K)."""
    from quack.families.gemm.epilogue import GATED, gated_ref

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16) / size**0.5
    for activation in GATED:
        def eager(activation=activation):
            return gated_ref(a @ b, activation)

        yield f"{activation} {size}^3", 2 * size**3, {
            "quack fused": lambda activation=activation: quack.gemm_glu(a, b, activation=activation),
            "quack gemm only": lambda: quack.gemm(a, b),
            "torch": eager,
            "torch.compile": _compiled(eager),
        }
    if not hasattr(torch, "_grouped_mm"):
        return
    for label, lengths in (("8x2048", [2048] * 8), ("64 uneven", _uneven_lengths(64, 32768))):
        x, w, w_cm, cu = _grouped_operands(lengths)

        def grouped(x=x, w_cm=w_cm, cu=cu):
            return gated_ref(torch._grouped_mm(x, w_cm, offs=cu[1:]), "swiglu")

        yield f"swiglu grouped {label}", 2 * sum(lengths) * 4096 * 4096, {
            "quack fused": lambda x=x, w=w, cu=cu: quack.gemm_glu(x, w, cu_seqlens_m=cu),
            "quack gemm only": lambda x=x, w=w, cu=cu: quack.gemm(x, w, cu_seqlens_m=cu),
            "torch": grouped,
            "torch.compile": _compiled(grouped),
        }


def main() -> None:
    args = parse_args("gemm.png", tables=("products", "epilogues", "backward", "inference"))
    if args.only == "inference":
        print_inference()
        print_moe_decode()
        return
    if args.only in (None, "products"):
        print_products(args.plot)
    if args.only in (None, "epilogues"):
        print_epilogues()
    if args.only in (None, "backward"):
        print_standalone_backward()


def print_products(plot_path: str) -> None:
    """The plain, backward-layout and grouped products against the references."""
    title = "GEMM bf16 (H200)"
    names = ["quack", "cuBLAS", "torch._grouped_mm", "matmul loop"]
    print(f"\n{title}\n{'case':<34}" + "".join(f"{n:>20}" for n in names) + f"{'quack/best ref':>16}")
    rows = []
    for label, flops, impls in cases():
        available = {}
        for name in names:  # a reference this torch lacks is reported, not fatal
            try:
                if impls.get(name):
                    impls[name]()
                    available[name] = impls[name]
            except Exception as exc:
                print(f"  {name} failed on {label}: {type(exc).__name__}: {exc}")
        ms = interleaved_ms(available)
        row = {"case": label, **{name: flops / (ms[name] * 1e-3) / 1e12 if name in ms else float("nan")
                                 for name in names}}
        refs = [row[n] for n in names[1:] if row[n] == row[n]]
        ratio = f"{100 * row['quack'] / max(refs):.0f}%" if refs else "-"
        print(f"{label:<34}" + "".join(f"{row[n]:>20.1f}" for n in names) + f"{ratio:>16}")
        rows.append(row)
    if plot_path:
        plot(title, rows, names, None, "TFLOP/s", plot_path)


def print_epilogues(cases=None) -> None:
    """The fused-epilogue table over ``cases`` (default: every epilogue and gated case)."""
    names = ["quack fused", "quack gemm only", "torch", "torch.compile"]
    print(f"\nFused epilogue, bf16 (TFLOP/s of the GEMM)\n{'case':<34}" + "".join(f"{n:>18}" for n in names)
          + f"{'fused/gemm':>12}{'fused/best torch':>18}")
    for label, flops, impls in cases if cases is not None else (*epilogue_cases(), *glu_cases()):
        for fn in impls.values():
            fn()
        ms = interleaved_ms(impls)
        t = {name: flops / (ms[name] * 1e-3) / 1e12 for name in names}
        print(f"{label:<34}" + "".join(f"{t[n]:>18.1f}" for n in names)
              + f"{100 * t['quack fused'] / t['quack gemm only']:>11.0f}%"
              + f"{100 * t['quack fused'] / max(t['torch'], t['torch.compile']):>17.0f}%")


def standalone_backward_cases(m: int = 8192, k: int = 4096, n: int = 4096):
    """gemm(activation) forward + backward, where no GEMM produces the
    incoming gradient: its dZ = dY * act'(Z) is one elementwise kernel over
    the saved pre-activation (quack/families/gemm/dact.py; quack.mlp fuses it into the
    dH GEMM's epilogue instead), timed beside the plain GEMM's forward +
    backward, and the kernel alone beside torch's own backward kernel of the
    activation on the same bf16 tensors."""
    from quack.families.gemm.dact import activation_grad

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = (torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)  # a pre-activation

    def step(activation):
        return lambda: quack.gemm(a, b, activation=activation).backward(dy)

    return {"plain": step(None), "silu": step("silu"), "gelu_tanh": step("gelu_tanh"),
            "silu dZ, quack": lambda: activation_grad(dy, z, "silu"),
            "silu dZ, torch": lambda: torch.ops.aten.silu_backward(dy, z),
            "gelu_tanh dZ, quack": lambda: activation_grad(dy, z, "gelu_tanh"),
            "gelu_tanh dZ, torch": lambda: torch.ops.aten.gelu_backward(dy, z, approximate="tanh")}


def print_standalone_backward() -> None:
    impls = standalone_backward_cases()
    for fn in impls.values():
        fn()
    ms = interleaved_ms(impls)
    print("\ngemm(activation) forward + backward at 8192x4096x4096, bf16 (ms; dZ: the elementwise step alone)")
    for name, t in ms.items():
        print(f"  {name:<24}{t:8.3f}")


def print_inference() -> None:
    copy_tbs = copy_bandwidth()
    print(f"\nGEMM bf16 at inference shapes: us, quack / cuBLAS; TB/s of operand traffic and its share of "
          f"a device copy ({copy_tbs:.2f} TB/s)")
    print(f"{'K x N':<14}{'M':>6}{'quack us':>11}{'cuBLAS us':>11}{'quack/cuBLAS':>14}"
          f"{'quack TB/s':>12}{'%copy':>7}{'cuBLAS TB/s':>13}{'%copy':>7}")
    for k, n in WEIGHTS:
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in INFERENCE_M:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = interleaved_ms({"quack": lambda: quack.gemm(a, b), "cuBLAS": lambda: a @ b})
            traffic = 2 * (m * k + k * n + m * n)
            tbs = {name: traffic / (t * 1e-3) / 1e12 for name, t in ms.items()}
            print(f"{f'{k} x {n}':<14}{m:>6}{1e3 * ms['quack']:>11.1f}{1e3 * ms['cuBLAS']:>11.1f}"
                  f"{100 * ms['cuBLAS'] / ms['quack']:>13.0f}%"
                  f"{tbs['quack']:>12.2f}{100 * tbs['quack'] / copy_tbs:>6.0f}%"
                  f"{tbs['cuBLAS']:>13.2f}{100 * tbs['cuBLAS'] / copy_tbs:>6.0f}%")
        torch.cuda.empty_cache()


def print_moe_decode() -> None:
    gen = torch.Generator().manual_seed(0)
    print("\nMoE decode, bf16 (us): grouped quack.gemm against torch._grouped_mm and a matmul loop")
    print(f"{'experts x K x N':<22}{'tokens':>8}{'quack':>10}{'_grouped_mm':>13}{'matmul loop':>13}")
    for experts, k, n in MOE_DECODE:
        lengths = torch.randint(0, 17, (experts,), generator=gen).tolist()
        a = torch.randn(sum(lengths), k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(experts, k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
        b_cm = b.transpose(1, 2).contiguous().transpose(1, 2)  # column-major per expert, as cuBLASLt wants
        cu = torch.nn.functional.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
        bounds = cu.tolist()
        impls = {"quack": lambda: quack.gemm(a, b, cu_seqlens_m=cu),
                 "matmul loop": lambda: [a[bounds[g]:bounds[g + 1]] @ b[g] for g in range(experts)]}
        if hasattr(torch, "_grouped_mm"):
            impls["_grouped_mm"] = lambda: torch._grouped_mm(a, b_cm, offs=cu[1:])
        ms = interleaved_ms(impls)
        grouped = f"{1e3 * ms['_grouped_mm']:.1f}" if "_grouped_mm" in ms else "-"
        print(f"{f'{experts} x {k} x {n}':<22}{sum(lengths):>8}{1e3 * ms['quack']:>10.1f}{grouped:>13}"
              f"{1e3 * ms['matmul loop']:>13.1f}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
