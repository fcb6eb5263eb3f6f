"""One GEMM product on checked operands: the launch of its plan's object,
the registered op that torch.compile's graphs call, and the empty product
(which launches nothing).  Below both the public ops and their autograd
Functions, which run their products here."""

from __future__ import annotations

from typing import Optional

import torch

from quack.calls import torch_interop as ti
from quack.calls.cute_op import cute_op
from quack.calls.plan import Kernel, Plan, plan_for
from quack.compile_only import is_compile_only
from quack.families.gemm.config import GemmConfig, gemm_config, group_class, kernel_grouping, resident_clusters
from quack.families.gemm.epilogue import TORCH_ACTIVATIONS, parse_epilogue
from quack.families.gemm.operands import Operands, check_tma, columns
from quack.families.gemm.signature import GEMM, compile_gemm, plan_of, signature_of
from quack.families.gemm.split import dense_class, split_buffers, split_plan


def product(ops: Operands, cu, plan: Optional[Plan] = None, warm_empty: bool = True) -> torch.Tensor:
    """Run one product into ``ops.out`` through ``plan`` (None: this call's
    own, planned here).  An empty product launches nothing (compile-only mode
    still warms the plan of a call, ``warm_empty``; not that of a backward's
    product, whose kernels the call's plan holds)."""
    plan = plan if plan is not None else plan_of(ops)
    if ops.empty:
        if plan is not None and warm_empty and is_compile_only():
            plan.warm()
        return _empty_product(ops)
    if plan is None:
        _gemm(ops.a, ops.b3, ops.out, cu, ops.bias, ops.preact, ops.a_m_major, ops.b_n_major, ops.activation)
        return ops.out
    _run(plan, ops, cu)
    return ops.out


def _empty_product(ops: Operands) -> torch.Tensor:
    """An empty product: K = 0 gives act(bias) (zeros without a bias; a gated
    product gives act(0) * 0 = 0, a derivative 0 * act'(Z) = 0)."""
    z = ops.out.zero_()
    if ops.epilogue.derivative:
        return z  # (its preact is an input)
    if ops.epilogue.gated:
        if ops.preact is not None:
            ops.preact.zero_()
        return z
    if z.numel() and ops.bias is not None:
        z.add_(ops.bias)
    if ops.preact is not None:
        ops.preact.copy_(z)
    if z.numel() and ops.activation is not None:
        z.copy_(TORCH_ACTIVATIONS[ops.activation](z.float()))
    return z


def check_alignment(ops: Operands) -> None:
    """TMA's alignment rules on the tensors the kernel gets.  On real (or
    compile-only fake) tensors only: not while torch.compile traces, where
    the registered op checks them when the graph runs."""
    check_tma("A", ops.a, 0 if ops.a_m_major else -1)
    check_tma("B", ops.b3)
    if ops.bias is not None and ti.address(ops.bias) % 4:
        raise ValueError("bias must start at a 4-byte aligned address")


def _run(plan: Plan, ops: Operands, cu_seqlens) -> None:
    """Check TMA's alignment rules, then warm (compile-only) or launch the
    plan's object for this size."""
    check_alignment(ops)
    if is_compile_only():
        plan.warm()
        return
    role = run_role(plan, ops)
    a = ops.a.t() if ops.a_m_major else ops.a  # the kernel takes an M-contiguous A as (K, M)
    _launch(plan.kernel_of(role), plan.signature.config(role), a, ops.b3, ops.out.flatten(0, -2),
            cu_seqlens, ops.bias, ops.preact, (ops.a.shape[1], columns(ops.b3, ops.b_n_major)))


def run_role(plan: Plan, ops: Operands) -> str:
    """The role of the plan's object that runs this call: the grouping's,
    or the class of its size (group rows or M)."""
    grouping = plan.signature.grouping
    if grouping == "varlen_m":
        return group_class(ops.a.shape[0] / max(1, ops.b3.shape[0]))
    if grouping == "dense":
        n = columns(ops.b3, ops.b_n_major)
        device = ops.a.device
        # (A quarter of the L2 left for A, the split's workspace and the output.)
        weight_in_l2 = 4 * ops.b3.numel() * ops.b3.element_size() <= 3 * ti.l2_bytes(device.index or 0)
        slots = resident_clusters(gemm_config(n, m_class="mid_m"), device)
        return dense_class(ops.a.shape[0], n, slots, weight_in_l2)
    return grouping


@cute_op("quack::gemm", mutates_args=("out", "preact"))
def _gemm(a: torch.Tensor, b3: torch.Tensor, out: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
          bias: Optional[torch.Tensor], preact: Optional[torch.Tensor], a_m_major: bool, b_n_major: bool,
          activation: Optional[str]) -> None:
    """The registered op, which torch.compile's graphs call: a is (M, K),
    M-contiguous if ``a_m_major``; b3 is (L, K, N) if ``b_n_major`` else
    (L, N, K); out is (M, N), or (G, M, N) for varlen K; ``preact`` given for
    a training call with an activation; the plan comes from the real
    tensors."""
    epilogue = parse_epilogue(activation)
    ops = Operands(a, a_m_major, b3, b_n_major, out, kernel_grouping(out, cu_seqlens), bias, activation, epilogue,
                   preact)
    backward = preact is not None and not epilogue.derivative  # a derivative reads preact
    _run(plan_for(signature_of(ops, backward)), ops, cu_seqlens)


def launch_gemm(a, b3, out, cu_seqlens, b_n_major: bool, cfg: GemmConfig, a_m_major: bool = False,
                splits: Optional[int] = None) -> None:
    """Run a configuration of the caller's choice on validated operands
    (tools/bench/gemm_configs.py compares them; the op runs its plan's),
    with ``splits`` K splits where ``cfg.split_k`` (None: ``split_count``'s)."""
    args = (ti.dtype_name(a.dtype), ti.dtype_name(out.dtype), a_m_major, b_n_major, kernel_grouping(out, cu_seqlens),
            None, None, False, tuple(cfg))
    _launch(Kernel(compile_gemm, args, GEMM), cfg, a.t() if a_m_major else a, b3, out.flatten(0, -2), cu_seqlens,
            problem_kn=(a.shape[1], columns(b3, b_n_major)), splits=splits)


def _launch(kernel: Kernel, cfg: GemmConfig, a, b3, out, cu_seqlens, bias=None, preact=None,
            problem_kn: tuple[int, int] = (0, 0), splits: Optional[int] = None) -> None:
    """Launch on the kernel's views (an M-contiguous A as (K, M)); a
    split-K configuration gets its splits' buffers on the current stream
    (``problem_kn``: the product's K and B's N)."""
    max_clusters = resident_clusters(cfg, a.device)
    workspace = counters = None
    if cfg.split_k and not is_compile_only():  # (compile-only: the launch is a no-op)
        split = split_plan(cfg, out.shape[0], problem_kn[1], problem_kn[0], max_clusters)
        if splits is not None:
            split = split._replace(splits=splits)
        workspace, counters = split_buffers(cfg, split, a.device)
    kernel.run(a=a, b=b3, d=out, cu_seqlens=cu_seqlens, bias=bias, preact=preact, max_clusters=max_clusters,
               workspace=workspace, counters=counters)
