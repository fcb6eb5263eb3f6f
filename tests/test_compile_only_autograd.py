"""Autograd, torch.compile and the usual CUDA idioms inside compile-only mode (no GPU needed).

On a CUDA build of torch the backward pass is walked in Python
(quack/compile_only/autograd.py) and torch.cuda answers for the compile
target (quack/compile_only/gpu.py); on a CPU-only build such calls fail
with an error saying to use the CUDA build, never an abort.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import importlib

import quack
import quack.calls.plan
import quack.calls.torch_interop
from quack.compile_only import compile_only_mode
from quack.compile_only.gpu import CUDA_BUILD, CPU_BUILD_MESSAGE, missing_private_names

cuda_build = pytest.mark.skipif(not CUDA_BUILD, reason="autograd on fake CUDA tensors needs a CUDA build of torch")
cpu_build = pytest.mark.skipif(CUDA_BUILD, reason="the CPU-only build's guard")


@pytest.fixture
def no_compiles(monkeypatch):
    """Kernel loads recorded, nothing compiled: the kernels each call asks for."""
    loaded = []
    monkeypatch.setattr(quack.calls.plan.Kernel, "load", lambda kernel: loaded.append(kernel.describe()) or (lambda *a: None))
    monkeypatch.setenv("QUACK_ARCH", "sm_90a")
    return loaded


@cuda_build
def test_the_private_torch_names_relied_on_exist():
    assert missing_private_names() == []


@cuda_build
def test_backward_fits_gradients_to_each_leaf():
    with compile_only_mode():
        x = torch.randn(4, 8, device="cuda", requires_grad=True)
        w = torch.randn(8, 8, device="cuda", requires_grad=True)
        b = torch.zeros(8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        frozen = torch.randn(8, device="cuda")
        ((x @ w + b.float()) * frozen).relu().sum().backward()
        for leaf, dtype in ((x, torch.float32), (w, torch.float32), (b, torch.bfloat16)):
            assert isinstance(leaf.grad, FakeTensor) and leaf.grad.device.type == "cuda"
            assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == dtype
        assert frozen.grad is None
        first = x.grad
        (x * 3).sum().backward()
        assert x.grad is first  # accumulated in place, as the engine does


@cuda_build
def test_autograd_grad_inputs_unused_and_create_graph():
    with compile_only_mode():
        x = torch.randn(4, 8, device="cuda", requires_grad=True)
        unused = torch.randn(3, device="cuda", requires_grad=True)
        h = x.sin()
        gx, gh, gu = torch.autograd.grad((h * h).sum(), [x, h, unused], allow_unused=True)
        assert gx.shape == (4, 8) and gh.shape == (4, 8) and gu is None and x.grad is None
        with pytest.raises(RuntimeError, match="appears to not have been used"):
            torch.autograd.grad(x.sum(), [unused])
        (g,) = torch.autograd.grad((x**3).sum(), [x], create_graph=True)
        assert g.grad_fn is not None
        (gg,) = torch.autograd.grad(g.sum(), [x])
        assert gg.shape == (4, 8)
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.ones(2, device="cuda").sum().backward()


@cuda_build
def test_backward_inputs_accumulates_only_into_them_and_hooks_run():
    with compile_only_mode():
        a = torch.randn(4, device="cuda", requires_grad=True)
        b = torch.randn(4, device="cuda", requires_grad=True)
        seen = []
        a.register_hook(lambda g: seen.append("hook") or g * 2)
        a.register_post_accumulate_grad_hook(lambda t: seen.append("post"))
        (a * b).sum().backward(inputs=[a], retain_graph=True)
        assert a.grad is not None and b.grad is None and seen == ["hook", "post"]


@cuda_build
def test_a_custom_function_gets_its_gradients_mapped_to_its_tensor_arguments():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, factor, other, y):
            return x * factor + y

        @staticmethod
        def backward(ctx, grad):
            return grad * 2, None, None, grad.sum(0)

    with compile_only_mode():
        x = torch.randn(4, 8, device="cuda", requires_grad=True)
        y = torch.randn(8, device="cuda", requires_grad=True)
        Scale.apply(x, 2.0, torch.ones(1, device="cuda"), y).sum().backward()
        assert x.grad.shape == (4, 8) and y.grad.shape == (8,)


@cuda_build
def test_a_training_loop_with_module_cuda_optimizers_and_sentinel_checks():
    with compile_only_mode():
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2)).cuda()
        assert model[0].weight.device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        steps = []
        opt.register_step_post_hook(lambda *args: steps.append(1))
        scaler = torch.amp.GradScaler("cuda")
        assert scaler.is_enabled()
        for _ in range(2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(torch.randn(4, 8, device="cuda"))
                assert out.dtype == torch.bfloat16  # as on the GPU: autocast is on
            loss = out.float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            scaler.step(opt)  # a sentinel is no inf: the step runs
            scaler.update()
            opt.zero_grad()
        assert steps == [1, 1]
        assert all(p.grad is None for p in model.parameters())


@cuda_build
def test_cuda_answers_for_the_compile_target_inside_the_mode_only(monkeypatch):
    monkeypatch.setenv("QUACK_ARCH", "sm_100a")
    real = torch.cuda.is_available()
    with compile_only_mode():
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.cuda.get_device_capability() == (10, 0) and torch.cuda.is_bf16_supported()
        assert torch.cuda.get_device_properties(0).multi_processor_count == quack.calls.torch_interop.sm_count(0)
        torch.cuda.synchronize()
        assert torch.randn(8, 8, device="cuda")[:4].shape == (4, 8)  # the fake device guard stays
        # Housekeeping a test or a training script does, answered without a driver.
        torch.cuda.set_device(0)
        with torch.cuda.device(0):
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        assert free == total == torch.cuda.get_device_properties(0).total_memory
        assert torch.cuda.max_memory_allocated() == 0 and "compile-only" in torch.cuda.memory_summary()
    assert torch.cuda.is_available() is real


@cuda_build
def test_rmsnorm_backward_runs_its_own_backward(no_compiles, monkeypatch):
    calls = []
    module = importlib.import_module("quack.families.rmsnorm.op")
    real_bwd = module.rmsnorm_bwd
    monkeypatch.setattr(module, "rmsnorm_bwd", lambda *a, **k: calls.append(1) or real_bwd(*a, **k))
    with compile_only_mode():
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.nn.Parameter(torch.ones(256, device="cuda"))
        y = quack.rmsnorm(x, w)
        assert y.requires_grad and not calls
        y.float().sum().backward()
        assert calls == [1] and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert any(k.startswith("compile_rmsnorm_bwd") for k in no_compiles)


@cuda_build
def test_torch_compile_of_a_module_runs_the_captured_graph_and_its_backward(no_compiles):
    with compile_only_mode():
        model = torch.nn.Linear(256, 256).cuda()
        compiled = torch.compile(lambda x: quack.rmsnorm(model(x), None) * 2, fullgraph=True, mode="max-autotune")
        x = torch.randn(8, 256, device="cuda", requires_grad=True)
        compiled(x).sum().backward()
        assert x.grad.shape == (8, 256) and model.weight.grad.shape == (256, 256)
    assert any(k.startswith("compile_rmsnorm_bwd") for k in no_compiles)


@cuda_build
@pytest.mark.parametrize("dynamic, mode", [(None, None), (True, None), (False, "reduce-overhead"), (None, "max-autotune")])
def test_torch_compile_variants_warm_what_eager_warms(no_compiles, dynamic, mode):
    """A function compiled with each dynamic= and mode= variant, not fullgraph, as a team writes it."""
    torch._dynamo.reset()
    with compile_only_mode():
        w = torch.nn.Parameter(torch.ones(512, device="cuda"))
        compiled = torch.compile(lambda x: quack.rmsnorm(x, w).relu(), dynamic=dynamic, mode=mode)
        for rows in (16, 48):  # a second shape: a recompile, or the dynamic graph again
            x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            compiled(x).float().sum().backward()
            assert x.grad.shape == (rows, 512) and w.grad.shape == (512,)
    assert any(k.startswith("compile_rmsnorm_fwd") for k in no_compiles)
    assert any(k.startswith("compile_rmsnorm_bwd") for k in no_compiles)


def _training_step_ops():
    """Ops that allocate per-row statistics, called as a model's training step calls them."""
    def layernorm(x):
        w = torch.nn.Parameter(torch.ones(x.shape[-1], device="cuda"))
        b = torch.nn.Parameter(torch.zeros(x.shape[-1], device="cuda"))
        return lambda t: quack.layernorm(t, w, b), (w, b)

    def rmsnorm_residual(x):
        w = torch.nn.Parameter(torch.ones(x.shape[-1], device="cuda"))
        return lambda t: sum(quack.rmsnorm(t, w, residual=t * 2)), (w,)

    def cross_entropy(x):
        return lambda t: quack.cross_entropy(t, torch.zeros(t.shape[:-1], dtype=torch.long, device="cuda")), ()

    return {"layernorm": layernorm, "rmsnorm_residual": rmsnorm_residual, "cross_entropy": cross_entropy}


@cuda_build
@pytest.mark.parametrize("op", sorted(_training_step_ops()))
def test_dynamic_shapes_over_ops_with_per_row_outputs(no_compiles, op):
    """torch.compile(dynamic=True) of (batch, seq, hidden) inputs at two sequence lengths, then backward."""
    torch._dynamo.reset()
    with compile_only_mode():
        fn, params = _training_step_ops()[op](torch.empty(1, 1, 512, device="cuda"))
        compiled = torch.compile(lambda t: fn(t).float().sum(), dynamic=True)
        for seq in (16, 40):
            x = torch.randn(2, seq, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            compiled(x).backward()
            assert x.grad.shape == x.shape and all(p.grad.shape == p.shape for p in params)
    family = op.split("_residual")[0]
    assert any(k.startswith(f"compile_{family}_bwd") for k in no_compiles)


@cuda_build
def test_autograd_backward_called_directly_and_checkpointing(no_compiles):
    from torch.utils.checkpoint import checkpoint

    with compile_only_mode():
        w = torch.nn.Parameter(torch.ones(256, device="cuda"))
        x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = checkpoint(lambda t: quack.rmsnorm(t, w), x, use_reentrant=False)
        torch.autograd.backward([y.float().sum()], retain_graph=True)
        assert x.grad.shape == (8, 256) and w.grad.dtype == torch.float32
        torch.autograd.backward(y, grad_tensors=torch.ones_like(y))
    assert any(k.startswith("compile_rmsnorm_bwd") for k in no_compiles)


@cpu_build
@pytest.mark.parametrize("call", ["linear", "function", "backward"])
def test_a_cpu_only_torch_refuses_autograd_with_an_error_not_an_abort(call, no_compiles):
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    with pytest.raises(RuntimeError, match="needs the CUDA build of torch"):
        with compile_only_mode():
            w = torch.nn.Parameter(torch.randn(8, 8, device="cuda"))
            x = torch.randn(4, 8, device="cuda")
            with torch.no_grad():
                assert torch.nn.functional.linear(x, w).shape == (4, 8)  # no graph: fine
            if call == "linear":
                torch.nn.functional.linear(x, w)
            elif call == "function":
                Double.apply(w)
            else:
                weight = torch.nn.Parameter(torch.ones(256, device="cuda"))
                quack.rmsnorm(torch.randn(4, 256, device="cuda", dtype=torch.bfloat16), weight).sum().backward()
    assert CPU_BUILD_MESSAGE.startswith("autograd on fake CUDA tensors")
