"""Where the GEMM epilogue's values go, checked at trace time (CPU, no GPU).

The epilogue reads each accumulator's (row, col) from the MMA's own layout
(``r2s.retile`` of the accumulator coordinates: the bias column) and copies
the values to shared memory with ``gemm_kernels.epilogue_copy``.  stmatrix
moves 16-bit values between the lanes of a warp, so a thread's destination
coordinates are not its values' (the bias must not read them); a plain fp32
store must put every value at its own coordinate.
"""

import pytest

cute = pytest.importorskip("cutlass.cute")

import cutlass  # noqa: E402
import cutlass.tensor_utils as tensor_utils  # noqa: E402
import cutlass.utils.hopper_helpers as sm90  # noqa: E402

from quack.cache.key import options_for_arch  # noqa: E402
from quack.families.gemm.kernel import EPILOGUE_N, epilogue_copy  # noqa: E402

TILE = (128, 256)
VALUES = TILE[0] * EPILOGUE_N // 256  # one 32-column subtile over two consumer warpgroups


def _coordinates(d_dtype, threads=(0, 1, 5, 37, 200)):
    """Per thread: (the accumulators' coordinates in copy order, the copy's
    destination coordinates) of the first subtile."""
    got = {}

    @cute.jit
    def trace():
        tiled_mma = sm90.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            cutlass.Float32, (2, 1, 1), tiler_mn=(64, TILE[1]),
        )
        r2s = epilogue_copy(tiled_mma, tensor_utils.LayoutEnum.ROW_MAJOR, d_dtype)
        for t in threads:
            source = r2s.retile(tiled_mma.get_slice(t).partition_C(cute.make_identity_tensor(TILE)))
            dest = r2s.get_slice(t).partition_D(cute.make_identity_tensor((TILE[0], EPILOGUE_N)))
            got[t] = ([tuple(source[v]) for v in range(VALUES)], [tuple(dest[v]) for v in range(VALUES)])

    cute.compile(trace, options=options_for_arch("sm_90a"))  # traced for the H200, whatever GPU is here
    return got


def test_fp32_values_land_on_their_own_coordinates():
    for source, dest in _coordinates(cutlass.Float32).values():
        assert source == dest


def test_bias_columns_come_from_the_accumulator_layout():
    got = _coordinates(cutlass.BFloat16)
    # The MMA's accumulator layout: lane l of warp 0 holds rows l // 4 and
    # l // 4 + 8, columns 2 (l % 4) + {0, 1} + 8 j.
    for t, (source, dest) in got.items():
        lane, warp = t % 32, t // 32
        row = lane // 4 + 16 * (warp % 4) + 64 * (warp // 4)
        cols = {c for _, c in source}
        assert {r for r, _ in source} == {row, row + 8}
        assert cols == {2 * (lane % 4) + k + 8 * j for k in (0, 1) for j in range(4)}
        assert all(c < EPILOGUE_N for c in cols)
    # stmatrix moves values between lanes: its destinations are not the values' own coordinates.
    assert any(source != dest for source, dest in got.values())


def _accumulator_coordinates(tile_n, threads):
    """Per thread: the (row, col) of each accumulator of a (128, tile_n) tile, in index order."""
    got = {}

    @cute.jit
    def trace():
        tiled_mma = sm90.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            cutlass.Float32, (2, 1, 1), tiler_mn=(64, tile_n),
        )
        for t in threads:
            coords = tiled_mma.get_slice(t).partition_C(cute.make_identity_tensor((TILE[0], tile_n)))
            got[t] = [tuple(coords[v]) for v in range(cute.size(coords))]

    cute.compile(trace, options=options_for_arch("sm_90a"))
    return got


def test_gated_epilogue_moves_each_product_to_its_column():
    """``HopperGemm._gate``'s index arithmetic, replayed on the traced
    layouts: the gate and up values it pairs are columns 2 j and 2 j + 1 of
    one row, and after its shuffles every lane holds, at each index, the
    product of the D column the half-width MMA's layout puts there."""
    warp = range(32, 64)  # the second warp: rows 16 to 31
    full = _accumulator_coordinates(TILE[1], warp)
    half = _accumulator_coordinates(TILE[1] // 2, warp)
    products = {}  # per lane: (x0, x1) of each (chunk, row half), as D coordinates
    for t in warp:
        for j in range(len(half[t]) // 4):
            for r in range(2):
                pair = []
                for first in (8 * j + 2 * r, 8 * j + 2 * r + 4):
                    (row, gate), (row_up, up) = full[t][first], full[t][first + 1]
                    assert row == row_up and gate % 2 == 0 and up == gate + 1
                    pair.append((row, gate // 2))
                products[t, j, r] = pair
    for t in warp:
        q = t % 4
        for j in range(len(half[t]) // 4):
            for r in range(2):
                for c in range(2):
                    source = t - q + (2 * q + c) % 4
                    assert products[source, j, r][1 if q >= 2 else 0] == half[t][4 * j + 2 * r + c]


def test_gate_gradients_fetch_the_gradient_of_their_columns():
    """``HopperGemm._gate_gradients``'s index arithmetic, replayed: each lane's
    pair of D columns (2 j, 2 j + 1: the gate and up of column j) in the
    double-width MMA's layout gets, through its shuffle, the accumulator of
    column j in the same row."""
    warp = range(32, 64)
    full = _accumulator_coordinates(128, warp)
    double = _accumulator_coordinates(256, warp)
    for t in warp:
        q = t % 4
        for c in range(len(double[t]) // 4):
            for r in range(2):
                source = t - q + (4 * (c % 2) + q) // 2
                row, j = full[source][2 * r + 4 * (c // 2) + q % 2]
                assert double[t][4 * c + 2 * r] == (row, 2 * j)
                assert double[t][4 * c + 2 * r + 1] == (row, 2 * j + 1)
