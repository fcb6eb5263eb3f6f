"""A team's own GPU tests of a model built on quack, written as such a team
would write them: no quack test helpers, no quack marker, the usual CUDA
guards.  `pytest --compile-only` must run each to its end on a machine
without a GPU (with a CUDA build of torch) and warm exactly the kernels the
GPU run loads; on a GPU the same file runs as ordinary tests.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper GPU",
)

DIM, HIDDEN = 256, 256


class MLPBlock(nn.Module):
    """Pre-norm SwiGLU block: x + W_down(swiglu(norm(x) @ W_up)), an fp32 norm weight beside bf16 activations."""

    def __init__(self, dim=DIM, hidden=HIDDEN, device=DEVICE):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(dim, device=device))
        self.w_up = nn.Parameter(torch.randn(dim, 2 * hidden, device=device, dtype=torch.bfloat16) * dim**-0.5)
        self.w_down = nn.Parameter(torch.randn(hidden, dim, device=device, dtype=torch.bfloat16) * hidden**-0.5)

    def forward(self, x):
        h = quack.rmsnorm(x, self.norm_weight, eps=1e-6)
        return x + quack.gemm(quack.gemm_glu(h, self.w_up), self.w_down)


def reference(x, norm_weight, w_up, w_down):
    """The block in plain torch; W_up's columns interleave gate and up."""
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight).to(x.dtype)
    up = h @ w_up
    act = F.silu(up[:, 0::2].float()) * up[:, 1::2].float()
    return x + act.to(x.dtype) @ w_down


def assert_close_scaled(actual, expected, rel=3e-2):
    """bf16 results: within a few percent of the expected tensor's largest entry."""
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), atol=rel * scale, rtol=rel)


@pytest.fixture
def cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return torch.device("cuda")


@pytest.mark.parametrize("tokens", [64, 200])
def test_block_matches_reference_forward_and_backward(tokens):
    torch.manual_seed(0)
    block = MLPBlock()
    x = torch.randn(tokens, DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out = block(x)
    assert out.shape == (tokens, DIM) and out.dtype == torch.bfloat16
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    params = [p.detach().clone().requires_grad_() for p in (block.norm_weight, block.w_up, block.w_down)]
    x_ref = x.detach().clone().requires_grad_()
    expected = reference(x_ref, *params)
    expected.backward(grad_out)

    assert_close_scaled(out, expected)
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert block.norm_weight.grad.dtype == torch.float32
    assert_close_scaled(x.grad, x_ref.grad)
    for got, want in zip((block.norm_weight, block.w_up, block.w_down), params):
        assert got.grad.shape == got.shape
        assert_close_scaled(got.grad, want.grad, rel=5e-2)


def test_training_loop():
    torch.manual_seed(0)
    model = nn.Sequential(MLPBlock(), MLPBlock())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        x = torch.randn(64, DIM, device=DEVICE, dtype=torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, error_if_nonfinite=True)
        optimizer.step()
        losses.append(loss.detach())
    assert all(p.grad is not None for p in model.parameters())
    torch.testing.assert_close(torch.stack(losses).isfinite(), torch.ones(3, dtype=torch.bool, device=DEVICE))


def test_inference_loop():
    block = MLPBlock().eval()
    with torch.inference_mode():
        for tokens in (64, 200):
            x = torch.randn(tokens, DIM, device=DEVICE, dtype=torch.bfloat16)
            out = block(x)
            assert out.shape == x.shape and not out.requires_grad
            assert_close_scaled(out, reference(x, block.norm_weight, block.w_up, block.w_down))


def test_compiled_block_matches_eager():
    torch.manual_seed(0)
    block = MLPBlock()
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(64, DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out = compiled(x)
    out.float().sum().backward()
    assert x.grad is not None and block.w_up.grad is not None
    with torch.no_grad():
        assert_close_scaled(out, block(x))


def test_autocast_region_with_grad_scaler(cuda_device):
    torch.manual_seed(0)
    proj = nn.Linear(DIM, DIM).cuda()
    norm_weight = nn.Parameter(torch.ones(DIM, device=cuda_device))
    optimizer = torch.optim.SGD([*proj.parameters(), norm_weight], lr=1e-2, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(2):
        x = torch.randn(64, DIM, device=cuda_device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = proj(x)
            assert h.dtype == torch.bfloat16
            y = quack.rmsnorm(h, norm_weight)
        loss = y.float().pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(proj.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    assert norm_weight.grad is not None and proj.weight.grad.dtype == torch.float32


def test_module_moved_with_cuda_and_to():
    block = MLPBlock(device="cpu").cuda()
    assert block.w_up.device.type == "cuda"
    block = block.to(torch.device("cuda"))
    x = torch.randn(64, DIM, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert block(x).shape == x.shape
    torch.cuda.synchronize()
