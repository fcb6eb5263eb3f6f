"""The norm backward's per-CTA partial sums of dw and db, and their sum.

The kernel writes each CTA's fp32 partial rows of every gradient it
computes; here they share one (rows, count * N) buffer, dw's in the first N
columns and db's in the next, so one column sum reduces both.  A column sum
over a few hundred rows is latency-bound: it costs about as much over 2N
columns as over N, so LayerNorm's two gradients pay for one.  Many short
rows (a few thousand columns) are summed faster still as a matrix-vector
product with a vector of ones, which cuBLAS reads at full bandwidth (the
same bits from run to run: its GEMV takes no atomics); few long rows
stay with the column sum, which reads them faster.  The kernel takes each
gradient's columns as a view with the buffer's row stride."""

from __future__ import annotations

import torch

from quack.calls import torch_interop as ti
from quack.compile_only import is_compile_only

# The widest partial rows summed as a GEMV; wider ones take torch's column sum.
GEMV_MAX_COLUMNS = 16384


def partial_rows(rows: int, n: int, count: int, device: torch.device, m: int) -> torch.Tensor:
    """The fp32 (rows, count * N) buffer of ``count`` gradients' partial
    sums over M rows: left uninitialised when the kernel runs (its launch
    writes every one of the rows), zeros when it does not (M = 0)."""
    allocate = torch.empty if m > 0 else torch.zeros
    return allocate(rows, count * n, device=device, dtype=torch.float32)


def gradient_rows(partials: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Each gradient's (rows, N) view of the buffer, in order."""
    return [partials[:, i * n:(i + 1) * n] for i in range(partials.shape[1] // n)]


def sum_partial_rows(partials: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """outs[i] = the column sums of gradient i's partial rows, in out's
    dtype.  Skipped in compile-only mode: nothing was launched, and
    CPU-only torch cannot convert fake CUDA tensors."""
    if is_compile_only():
        return
    # Under autocast a GEMV would run in 16 bits (torch lowers mv); the column sum stays fp32.
    gemv = partials.shape[1] <= GEMV_MAX_COLUMNS and not torch.is_autocast_enabled(partials.device.type)
    ones = _ones(partials.shape[0], partials.device) if gemv else None
    if len(outs) == 1 and outs[0].dtype == torch.float32:
        if gemv:
            torch.mv(partials.t(), ones, out=outs[0])
        else:
            torch.sum(partials, 0, out=outs[0])
        return
    sums = torch.mv(partials.t(), ones) if gemv else partials.sum(0)
    n = sums.numel() // len(outs)
    for i, out in enumerate(outs):
        out.copy_(sums[i * n:(i + 1) * n])


_ONES: dict[tuple[torch.device, int], torch.Tensor] = {}


def _ones(rows: int, device: torch.device) -> torch.Tensor:
    """A (rows,) fp32 vector of ones: a view of one kept per device and
    stream, grown to the most rows seen.  Per stream, since its fill is
    queued on the stream that made it, and another stream could read it
    before that fill has run.  Outside a CUDA graph's capture only (a
    captured one lives in the graph's memory pool)."""
    key = (device, ti.current_stream(device) if device.type == "cuda" else 0)
    ones = _ONES.get(key)
    if ones is None or ones.shape[0] < rows:
        ones = torch.ones(rows, device=device, dtype=torch.float32)
        if not ti.capturing(device):
            _ONES[key] = ones
    return ones[:rows]
