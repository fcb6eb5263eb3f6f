"""The activation's backward as one elementwise kernel (CuTe DSL, sm_90a):
dZ = dY * act'(Z) from the pre-activation Z a forward saved, in fp32 between
the loads and the one rounding.  Gated (``gated``): Z holds gate and up
columns interleaved and dY half as many columns; dZ's gate column is
g * up * act'(gate), its up column g * act(gate) (``activation.gate_gradients``,
the math the GEMM's backward epilogues use).

Each CTA takes a (TILE_M, LANES_N vectors) tile of Z: a thread loads one
16-byte vector of Z per row of its share and the matching vector of dY (half
as wide when gated), so the pass reads dY and Z once and writes dZ once.
Rows and columns are dynamic and predicated per vector: one object per dtype
and activation.  Z's columns must be a multiple of the vector (the GEMM's
N % 8 rule), every row 16-byte aligned.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, const_expr

from quack.families.gemm.activation import activation_derivative, gate_gradients

THREADS = 256
LANES_N = 32  # threads along a tile row, one vector of Z each
ROWS_PER_THREAD = 4  # rows of the tile each thread takes: 4 vectors of Z and dY in flight
TILE_M = THREADS // LANES_N * ROWS_PER_THREAD


def _vector_atom(dtype, elements: int) -> cute.CopyAtom:
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=elements * dtype.width)


class ActivationGrad:
    """dZ = dY * act'(Z) (``activation`` a name of ``activation.activate``;
    ``vec`` Z's elements per 16 bytes)."""

    def __init__(self, activation: str, gated: bool, vec: int):
        self.activation = activation
        self.gated = gated
        self.vec = vec
        self.dy_vec = vec // 2 if gated else vec

    @cute.jit
    def __call__(self, grad_out: cute.Tensor, preact: cute.Tensor, grad_pre: cute.Tensor, stream: cuda.CUstream):
        threads = cute.make_ordered_layout((THREADS // LANES_N, LANES_N), order=(1, 0))
        z_copy = cute.make_tiled_copy_tv(_vector_atom(preact.element_type, self.vec), threads,
                                         cute.make_layout((1, self.vec)))
        dy_copy = cute.make_tiled_copy_tv(_vector_atom(grad_out.element_type, self.dy_vec), threads,
                                          cute.make_layout((1, self.dy_vec)))
        self.kernel(grad_out, preact, grad_pre, z_copy, dy_copy).launch(
            grid=[cute.ceil_div(preact.shape[0], TILE_M), cute.ceil_div(preact.shape[1], LANES_N * self.vec), 1],
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mDy: cute.Tensor, mZ: cute.Tensor, mDz: cute.Tensor, z_copy: cute.TiledCopy,
               dy_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        bm, bn, _ = cute.arch.block_idx()
        m, n = mZ.shape[0], mZ.shape[1]
        z_tile = (TILE_M, LANES_N * self.vec)
        gZ = cute.local_tile(mZ, z_tile, (bm, bn))
        gDz = cute.local_tile(mDz, z_tile, (bm, bn))
        gDy = cute.local_tile(mDy, (TILE_M, LANES_N * self.dy_vec), (bm, bn))
        gC = cute.local_tile(cute.make_identity_tensor((m, n)), z_tile, (bm, bn))
        z_thr, dy_thr = z_copy.get_slice(tidx), dy_copy.get_slice(tidx)
        tZgZ, tZgDz, tZcZ = z_thr.partition_S(gZ), z_thr.partition_D(gDz), z_thr.partition_S(gC)
        tYgDy = dy_thr.partition_S(gDy)
        # tZgZ: ((vec), ROWS_PER_THREAD, 1); tYgDy the same with dy_vec, the same rows and vectors.
        pred = cute.make_rmem_tensor(cute.make_layout((1, ROWS_PER_THREAD, 1), stride=(0, 1, 0)), Boolean)
        for r in range(ROWS_PER_THREAD):
            coord = tZcZ[(0, 0), r, 0]
            pred[0, r, 0] = cute.elem_less(coord[0], m) & cute.elem_less(coord[1], n)

        rZ, rDy = cute.make_rmem_tensor_like(tZgZ), cute.make_rmem_tensor_like(tYgDy)
        rZ.fill(0)
        rDy.fill(0)
        cute.copy(_vector_atom(mZ.element_type, self.vec), tZgZ, rZ, pred=pred)
        cute.copy(_vector_atom(mDy.element_type, self.dy_vec), tYgDy, rDy, pred=pred)
        grads = cute.make_rmem_tensor_like(rZ, Float32)
        for r in cutlass.range_constexpr(ROWS_PER_THREAD):
            # One row's vectors; index e is column e of the vector.
            z, dy, dz = rZ[None, r, 0], rDy[None, r, 0], grads[None, r, 0]
            if const_expr(self.gated):
                # Z's columns 2 e and 2 e + 1 are a (gate, up) pair; dY's column e is their output's gradient.
                for e in cutlass.range_constexpr(self.dy_vec):
                    dz[2 * e], dz[2 * e + 1] = gate_gradients(
                        dy[e].to(Float32), z[2 * e].to(Float32), z[2 * e + 1].to(Float32), self.activation
                    )
            else:
                for e in cutlass.range_constexpr(self.vec):
                    dz[e] = dy[e].to(Float32) * activation_derivative(z[e].to(Float32), self.activation)
        rDz = cute.make_rmem_tensor_like(tZgDz)
        rDz.store(grads.load().to(mDz.element_type))
        cute.copy(_vector_atom(mDz.element_type, self.vec), rDz, tZgDz, pred=pred)
