"""Split K, the GEMM's configuration for a few rows (decode steps): how many
splits a call gets (on the CPU), and on the GPU that the splits' sum is
right for every split count, the same bits from run to run, and safe on two
streams at once."""

import threading

import pytest
import torch

import quack
from quack.calls import fastpath
from quack.calls import torch_interop as ti
from quack.families.gemm import op as gemm_op
from quack.families.gemm import split
from quack.families.gemm.config import L2_SMALL_M_ROWS, MID_M_ROWS, SMALL_M_ROWS, gemm_config, resident_clusters
from quack.families.gemm.split import dense_class
from quack.families.gemm.product import launch_gemm, run_role
from quack.families.gemm.signature import GemmCall
from quack.calls.plan import plan_for


def test_split_count_fills_one_wave_with_whole_steps():
    # A decode step on a 4096 x 4096 weight: 32 tiles of 128 columns on 132 CTA slots.
    assert split.split_count(32, 4096, 132) == 4
    for tiles in (1, 3, 16, 40, 100, 131):
        for k in (8, 64, 520, 4096, 14336, 100000):
            splits = split.split_count(tiles, k, 132)
            steps = -(-k // split.TILE_K)
            assert 1 <= splits <= split.MAX_SPLITS
            assert splits == 1 or (steps // splits >= split.MIN_STEPS and tiles * splits <= 132)
    # Tiles enough to fill the GPU (or K too short to split) run unsplit.
    assert split.split_count(132, 14336, 132) == 1
    assert split.split_count(500, 14336, 132) == 1
    assert split.split_count(4, 64 * 15, 132) == 1


def test_dense_classes():
    # A decode step: the 64-row split object, whatever N.
    assert dense_class(1, 4096, 132) == dense_class(SMALL_M_ROWS, 128256, 132) == "small_m"
    # One tile row of 128: the 128-row split object, even over several waves
    # (the default's pairs of tile rows would leave half its CTAs idle).
    assert dense_class(SMALL_M_ROWS + 1, 4096, 132) == dense_class(128, 28672, 132) == "mid_m"
    # More rows: the 128-row object while its tiles fit in one wave.
    assert dense_class(256, 4096, 132) == dense_class(MID_M_ROWS, 4096, 132) == "mid_m"
    assert dense_class(129, 14336, 132) == dense_class(256, 8704, 132) == "dense"
    assert dense_class(256, 8704, 264) == "mid_m"
    assert dense_class(MID_M_ROWS + 1, 128, 132) == dense_class(8192, 4096, 132) == "dense"
    # B in L2: the 64-row object while its tiles fit in one wave, up to L2_SMALL_M_ROWS.
    assert dense_class(SMALL_M_ROWS + 1, 4096, 132, True) == dense_class(256, 4096, 132, True) == "small_m"
    assert dense_class(320, 4096, 132, True) == dense_class(L2_SMALL_M_ROWS + 1, 1024, 132, True) == "mid_m"
    assert dense_class(256, 4096, 132) == "mid_m"
    small, mid = gemm_config(4096, m_class="small_m"), gemm_config(4096, m_class="mid_m")
    assert small.split_k and (small.tile_m, small.tile_n) == (64, 128) and small.cluster_m == small.cluster_n == 1
    assert mid.split_k and (mid.tile_m, mid.tile_n) == (128, 128) and mid.cluster_m == mid.cluster_n == 1
    assert not gemm_config(4096).split_k
    roles = [role for role, _ in GemmCall("bfloat16", "bfloat16", False, True, "dense", 256, False, 0, None,
                                          None).kernels()]
    assert roles == ["dense", "small_m", "mid_m"]


@pytest.mark.parametrize("k,role", [(4096, "small_m"), (14336, "mid_m")])
def test_the_call_tells_the_rule_whether_its_weight_fits_in_l2(k, role):
    """128 rows by a 4096-column weight: 32 MB of bf16 fit an H100's or
    H200's L2 at K = 4096, 117 MB at K = 14336 do not."""
    a, b = torch.randn(128, k, dtype=torch.bfloat16), torch.randn(k, 4096, dtype=torch.bfloat16)
    ops, _ = gemm_op.call_operands(a, b, a.dtype, None, None, None, None, False)
    assert run_role(plan_for(gemm_op.signature_of(ops)), ops) == role


def test_split_buffers_per_stream_grow_by_doubling(monkeypatch):
    """Buffers per stream, grown to at least twice their size; an unsplit
    launch gets a token row and counter."""
    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

    stream = Stream(1)
    monkeypatch.setattr(split, "_BUFFERS", {})
    monkeypatch.setattr(split.torch.cuda, "current_stream", lambda device: stream)
    monkeypatch.setattr(ti, "capturing", lambda device: False)
    cfg, cpu = gemm_config(4096, m_class="small_m"), torch.device("cpu")
    tile = cfg.tile_m * cfg.tile_n
    workspace, counters = split.split_buffers(cfg, split.SplitPlan(tiles=1000, splits=1), cpu)
    assert workspace.shape == (1, 4) and counters.shape == (1,)
    workspace, counters = split.split_buffers(cfg, split.SplitPlan(tiles=4, splits=3), cpu)
    assert workspace.shape == (3, 4 * tile) and counters.shape == (4,) and not counters.any()
    first = workspace
    workspace, _ = split.split_buffers(cfg, split.SplitPlan(tiles=5, splits=3), cpu)
    assert workspace.shape == (3, 5 * tile) and workspace.data_ptr() != first.data_ptr()
    (kept,) = split._BUFFERS.values()
    assert kept.workspace.numel() == 2 * first.numel() and kept.counters.numel() == 2 * 4
    stream = Stream(2)
    other, _ = split.split_buffers(cfg, split.SplitPlan(tiles=4, splits=3), cpu)
    assert len(split._BUFFERS) == 2 and other.data_ptr() != workspace.data_ptr()


def test_fast_path_keeps_each_streams_buffers(monkeypatch):
    """The fast path keeps each stream's views in the dicts its launcher
    reads, and keeps them when that stream's buffers grow."""
    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

    streams = {1: Stream(1), 2: Stream(2)}
    current = [1]
    monkeypatch.setattr(split, "_BUFFERS", {})
    monkeypatch.setattr(split.torch.cuda, "current_stream", lambda device: streams[current[0]])
    monkeypatch.setattr(ti, "current_stream", lambda device: current[0])
    monkeypatch.setattr(ti, "capturing", lambda device: False)
    cfg, cpu = gemm_config(4096, m_class="small_m"), torch.device("cpu")
    plan = split.SplitPlan(tiles=4, splits=3)
    buffers = fastpath.PerStream(lambda: split.split_buffers(cfg, plan, cpu), cpu, 2)
    workspaces, counters = buffers.add_current()
    assert (workspaces, counters) == buffers.dicts and workspaces is buffers.dicts[0]
    first = workspaces[1], counters[1]
    assert first[0].shape == (3, 4 * cfg.tile_m * cfg.tile_n) and first[1].shape == (4,)
    split.split_buffers(cfg, split.SplitPlan(tiles=64, splits=3), cpu)  # stream 1's buffers grow
    assert workspaces[1] is first[0]  # the kept view still serves stream 1
    current[0] = 2
    buffers.add_current()
    assert set(workspaces) == set(counters) == {1, 2}
    assert workspaces[2].data_ptr() != first[0].data_ptr() and counters[2].data_ptr() != first[1].data_ptr()


def test_a_graph_capture_gets_buffers_of_its_own(monkeypatch):
    """While a CUDA graph is captured, every launch gets buffers of its own
    (the graph may replay on any stream, and their zeroing is the graph's,
    run only at replay), also where the stream's would hold it, and the fast
    path keeps none of them."""
    class Stream:
        cuda_stream = 1

    capturing = [False]
    monkeypatch.setattr(split, "_BUFFERS", {})
    monkeypatch.setattr(split.torch.cuda, "current_stream", lambda device: Stream())
    monkeypatch.setattr(ti, "current_stream", lambda device: 1)
    monkeypatch.setattr(ti, "capturing", lambda device: capturing[0])
    cfg, cpu = gemm_config(4096, m_class="small_m"), torch.device("cpu")
    plan = split.SplitPlan(tiles=4, splits=3)
    buffers = fastpath.PerStream(lambda: split.split_buffers(cfg, plan, cpu), cpu, 2)
    workspaces, counters = buffers.add_current()
    eager = workspaces[1], counters[1]
    capturing[0] = True
    own, own_counters = split.split_buffers(cfg, split.SplitPlan(tiles=2, splits=3), cpu)
    assert own.data_ptr() != eager[0].data_ptr() and own_counters.data_ptr() != eager[1].data_ptr()
    assert own.shape == (3, 2 * cfg.tile_m * cfg.tile_n) and not own_counters.any()
    (first, _), (second, _) = buffers.add_current(), buffers.add_current()  # tensors, fresh each call, kept nowhere
    assert len({first.data_ptr(), second.data_ptr(), eager[0].data_ptr()}) == 3
    assert buffers.dicts == ({1: eager[0]}, {1: eager[1]})


@pytest.mark.parametrize("rows", [2, 100])  # the 64-row and the 128-row split classes
def test_fast_path_passes_the_split_buffers_in_the_kernels_order(monkeypatch, rows):
    """The split classes' closure hands its launcher the streams' buffers
    where the kernel declares them, as dicts the launcher reads by the
    current stream; a stream without buffers yet is declined, and the
    closure adds them and launches again; under a capture the launcher
    declines the dicts (as the C launcher does) and the closure launches
    with add_current's own (a recording launcher; the GPU tests launch)."""
    calls, directs = [], []
    capturing = [False]

    def direct(plan, role, device, rows=None, per_stream=frozenset()):
        directs.append(per_stream)

        def launch(*a):
            calls.append(a)
            if len(calls) == 1 or (capturing[0] and any(isinstance(x, dict) for x in a)):  # no buffers; a capture
                return NotImplemented
            return None
        return launch

    monkeypatch.setattr(gemm_op.fastpath, "direct", direct)

    added = []

    def add_current(self):  # stream 7's buffers, or a capture's own
        added.append(True)
        if capturing[0]:
            return "own workspace", "own counters"
        self.dicts[0][7], self.dicts[1][7] = "workspace", "counters"
        return self.dicts

    monkeypatch.setattr(gemm_op.fastpath.PerStream, "add_current", add_current)
    a, b = torch.randn(rows, 4096), torch.randn(4096, 4096)
    ops, _ = gemm_op.call_operands(a, b, a.dtype, None, None, None, None, False)
    plan = plan_for(gemm_op.signature_of(ops))
    role = dense_class(rows, 4096, 132)
    run = gemm_op._dense_closure(plan, role, ops, ops.out)
    out = run(a, b, None, None, 0)
    names = plan.kernel_of(role).launch.parameters
    assert directs == [frozenset({names.index("workspace"), names.index("counters")})]
    assert len(calls) == 2 and calls[0][3:] == calls[1][3:]
    by_name = dict(zip(names, calls[1]))
    assert len(calls[1]) == len(names)
    assert by_name["stream"] is None  # (the launcher reads it)
    assert by_name["a"] is a and by_name["d"] is out and out.shape == (rows, 4096)
    assert by_name["workspace"] == {7: "workspace"} and by_name["counters"] == {7: "counters"}
    assert by_name["max_clusters"] > 0 and by_name["bias"] is None
    assert run(a, b, None, None, 0) is not NotImplemented and len(calls) == 3  # kept: one launch
    assert len(added) == 1
    capturing[0] = True  # a capture never launches with the kept buffers: add_current gives its own
    assert run(a, b, None, None, 0) is not NotImplemented and len(calls) == 5 and len(added) == 2
    by_name = dict(zip(names, calls[4]))
    assert by_name["workspace"] == "own workspace" and by_name["counters"] == "own counters"


def _operands(m, k, n, dtype=torch.bfloat16):
    torch.manual_seed(m * 7 + k + n)
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype) / k**0.5
    return a, b


@pytest.mark.gpu
@pytest.mark.parametrize("m_class,m", [("small_m", 1), ("small_m", 2), ("small_m", 37), ("small_m", 64),
                                       ("small_m", 130), ("small_m", 256),  # B in L2: several tile rows
                                       ("mid_m", 1), ("mid_m", 65), ("mid_m", 130), ("mid_m", 256)])
@pytest.mark.parametrize("k,n", [(8, 136), (72, 264), (64 * 41 + 8, 520), (4104, 4096)])
@pytest.mark.parametrize("a_m_major", [False, True])  # (M-contiguous: a partial last tile stays in place)
def test_every_split_count_sums_right(m_class, m, k, n, a_m_major):
    """Splits of unequal lengths, and more splits than K steps (the extra
    ones sum zeros), against fp32 torch; each count twice with the same bits."""
    a, b = _operands(m, k, n)
    ref = a.float() @ b.float()
    if a_m_major:
        # M-contiguous, its K stride padded to 16 bytes (TMA), as the op hands over any row count
        padded = torch.zeros(k, -(-m // 8) * 8, device="cuda", dtype=a.dtype)
        padded[:, :m] = a.t()
        a = padded[:, :m].t()
    cfg = gemm_config(n, m_class=m_class)
    for splits in (1, 2, 3, 5, 16):
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        launch_gemm(a, b.unsqueeze(0), out, None, True, cfg, a_m_major, splits=splits)
        first = out.clone()
        launch_gemm(a, b.unsqueeze(0), out, None, True, cfg, a_m_major, splits=splits)
        torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=2e-2)
        assert torch.equal(out, first), f"{splits} splits: bits differ between runs"


@pytest.mark.gpu
@pytest.mark.parametrize("m_class", ["small_m", "mid_m"])
@pytest.mark.parametrize("splits", [2, 3, 5, 16])
def test_a_rows_sum_has_the_same_bits_however_many_rows_share_its_tile(m_class, splits):
    """The last split sums a tile's slots spread over every warp where few
    warps hold rows (a decode step), each warp alone otherwise: both add the
    slots in split order, so a row's bits do not depend on the rows beside it."""
    a, b = _operands(128, 4104, 520)
    cfg = gemm_config(520, m_class=m_class)
    rows = {}
    for m in (1, 16, 17, 64, 128):  # one warp of real rows, two, a whole 64-row tile, two tiles
        rows[m] = torch.empty(m, 520, device="cuda", dtype=torch.bfloat16)
        launch_gemm(a[:m], b.unsqueeze(0), rows[m], None, True, cfg, False, splits=splits)
    for m, out in rows.items():
        assert torch.equal(out[0], rows[1][0]), f"{m} rows, {splits} splits: row 0's bits differ"
        assert m < 16 or torch.equal(out[:16], rows[16]), f"{m} rows, {splits} splits: rows 0 to 15 differ"


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 4096), (16, 4096), (64, 4096), (100, 4096), (256, 4096),
                                 (100, 14336), (256, 14336)])  # both split classes (B in L2 or not)
def test_decode_call_is_deterministic_and_leaves_counters_zero(m, k):
    a, b = _operands(m, k, 4096)
    first = quack.gemm(a, b)
    for _ in range(20):  # the fast path's calls too
        assert torch.equal(quack.gemm(a, b), first)
    torch.cuda.synchronize()
    torch.testing.assert_close(first.float(), a.float() @ b.float(), atol=5e-2, rtol=2e-2)
    for buffers in split._BUFFERS.values():
        assert int(buffers.counters.count_nonzero()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,role", [
    (100, 40960, "mid_m"),  # one tile row over several waves, unsplit
    (200, 4096, "small_m"),  # B in L2, 64-row tiles in one wave
    (300, 1024, "mid_m"),  # few tiles: split
    (300, 17408, "dense"),  # too many 128 x 128 tiles for one wave
    (513, 1024, "dense"),  # past the split classes
])
def test_each_class_of_a_few_hundred_rows(m, n, role):
    """quack.gemm where the class rule picks each object, against fp32 torch
    (with a bias, so the split epilogue's extras run too)."""
    a, b = _operands(m, 1032, n)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    slots = resident_clusters(gemm_config(n, m_class="mid_m"), a.device)
    assert dense_class(m, n, slots, 4 * b.numel() * b.element_size() <= 3 * ti.l2_bytes(a.device.index or 0)) == role
    out = quack.gemm(a, b, bias=bias)
    torch.testing.assert_close(out.float(), a.float() @ b.float() + bias.float(), atol=5e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.no_compile_only  # graphs of fake tensors; the tests above warm the same objects
def test_graphs_replay_in_any_order():
    """Two graphs captured one after the other, each with a split call; the
    second (smaller: the capture stream's buffers would hold it) replayed
    before the first ever has, then both: right sums each time."""
    big, small = _operands(64, 8192, 8192), _operands(16, 4096, 4096)
    refs = [quack.gemm(*big), quack.gemm(*small)]  # (eager: loads the objects before capturing)
    graphs, outs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()], []
    for graph, operands in zip(graphs, (big, small)):
        with torch.cuda.graph(graph):
            outs.append(quack.gemm(*operands))
    for i in (1, 0, 1, 0):
        graphs[i].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[i], refs[i]), f"graph {i}"


@pytest.mark.gpu
@pytest.mark.no_compile_only  # graphs of fake tensors; the tests above warm the same objects
def test_a_graph_replays_on_another_stream_beside_the_capture_streams_calls():
    """A split call captured on a stream whose buffers already served it,
    the graph replayed on a second stream while eager calls run on the
    first: the graph has buffers of its own, so every result is right."""
    a, b = _operands(16, 4096, 4096)
    ref = quack.gemm(a, b)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    for stream in (first, second):
        stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(first):
        quack.gemm(a, b)  # the first stream's buffers now hold the launch
        with torch.cuda.graph(graph, stream=first):
            captured = quack.gemm(a, b)
    torch.cuda.synchronize()
    replayed, eager = [], []
    for _ in range(20):
        with torch.cuda.stream(second):
            graph.replay()
            replayed.append(captured.clone())
        with torch.cuda.stream(first):
            eager.extend(quack.gemm(a, b) for _ in range(2))
    torch.cuda.synchronize()
    assert all(torch.equal(out, ref) for out in replayed), "graph replays"
    assert all(torch.equal(out, ref) for out in eager), "eager calls"


@pytest.mark.gpu
@pytest.mark.no_compile_only  # streams of fake tensors; the tests above warm the same objects
def test_streams_and_threads_do_not_share_counters():
    """Calls on two streams overlap; each stream has its own buffers."""
    shapes = [(1, 4096, 4096), (16, 2048, 8192)]
    operands = [_operands(*shape) for shape in shapes]
    refs = [quack.gemm(a, b) for a, b in operands]
    errors = []

    def work(i):
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.default_stream())  # the inputs and refs were made there
            a, b = operands[i]
            with torch.cuda.stream(stream):
                outs = [quack.gemm(a, b) for _ in range(50)]
            stream.synchronize()
            assert all(torch.equal(out, refs[i]) for out in outs)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_a_contiguous_decode_row_reaches_the_kernel_as_it_comes():
    """The fast path takes only the caller's own tensor: a contiguous row is
    passed as it is, a row of odd stride gets a view TMA accepts."""
    from quack.families.gemm.operands import _unit_strides

    row = torch.randn(8, 4096, dtype=torch.bfloat16)[-1:]
    assert _unit_strides(row) is row
    odd = torch.randn(1, 200).as_strided((1, 64), (12, 1))
    assert _unit_strides(odd).stride() == (64, 1)
    assert _unit_strides(torch.randn(1, 613)).stride() == (616, 1)
