"""The grad scores' fused gated-MLP activation (`scores.mlp`): which MLPs are fused, and the
kernels against the eager SiLU · up (under the Triton interpreter on CPU tensors, and on a GPU)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from resserve_export.algorithms.scores import mlp as ML
from tests.algorithms.test_norm import _loss_and_grad, _tiny, _ulps_and_share, assert_fused_scores_as_eager
from tests.fixtures.kernels_triton import gpu_kernels, no_gpu, run_interpreted


class GeluMLP(nn.Module):
    """Gated, with the attributes of one, but not SiLU: must keep its own forward."""

    def __init__(self, h: int = 64, i: int = 128):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False)
        self.act_fn = nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("flag", ["0", "1"])
def test_nothing_is_swapped_where_the_kernels_do_not_run(flag, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("RESSERVE_FUSED_MLP", flag)
    model = _tiny("qwen3")
    with ML.fused_mlps(model) as fused:
        assert fused is None
        assert not any("forward" in m.__dict__ for m in model.modules())


def test_only_gated_half_precision_mlps_are_candidates():
    model = _tiny("qwen3")
    assert sum(ML._gated(m) for m in model.modules()) == 2
    assert not any(ML._gated(m) for m in _tiny("qwen3", dtype=torch.float32).modules())
    with pytest.raises(ValueError, match="two bf16/fp16 tensors of one shape"):
        ML.silu_mul(torch.ones(2, 4), torch.ones(2, 4))


def _interpreted_check() -> None:
    """Run under ``TRITON_INTERPRET=1`` with ``RESSERVE_FUSED_MLP=1``."""
    _kernel_cases("cpu")
    _model_cases("cpu")


def _kernel_cases(device: str) -> None:
    """silu(g)·u and both gradients against the eager ops: within two ulps, ≥ 99% bit for bit;
    sizes that leave a partial block."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for n in (4096, 5000):
            g, u, dy = ((torch.randn(n, generator=gen) * 4).to(dtype).to(device) for _ in range(3))
            g1, u1 = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
            want = torch.nn.functional.silu(g1) * u1
            want_g, want_u = torch.autograd.grad(want, (g1, u1), dy)
            g2, u2 = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
            got = ML.silu_mul(g2, u2)
            got_g, got_u = torch.autograd.grad(got, (g2, u2), dy)
            for a, b in ((got, want), (got_g, want_g), (got_u, want_u)):
                ulps, share = _ulps_and_share(a.detach(), b.detach())
                assert a.dtype == b.dtype and ulps <= 2 and share >= 0.99, (dtype, n, ulps, share)


def _model_cases(device: str) -> None:
    """A tiny Qwen3 under `fused_mlps`: its MLP class fused, a GELU one not, the loss and input
    gradient of the scores' pass as without, and the forwards restored after."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    model = _tiny("qwen3", device=device)
    want = _loss_and_grad(model, ids)
    with ML.fused_mlps(model) as fused:
        got = _loss_and_grad(model, ids)
    assert {c.__name__: f for c, f in fused.items()} == {"Qwen3MLP": True}
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert math.isclose(float(got[0]), float(want[0]), rel_tol=1e-3)
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=0.02, atol=1e-3 * float(want[1].float().abs().max()))
    gelu = nn.Sequential(GeluMLP()).to(dtype=torch.bfloat16, device=device)
    with ML.fused_mlps(gelu) as fused:
        assert fused == {GeluMLP: False} and "forward" not in gelu[0].__dict__


@no_gpu
def test_fused_mlp_kernels_logic_under_the_triton_interpreter():
    """The kernels and the swap on CPU tensors, in a fresh interpreter with ``TRITON_INTERPRET=1``.
    Skipped where Triton is not installed (CPU-only torch does not bring it)."""
    run_interpreted("tests.algorithms.test_mlp", RESSERVE_FUSED_MLP="1")


triton_gpu = gpu_kernels(ML.available)


@pytest.mark.gpu
@triton_gpu
def test_gpu_fused_mlps_give_the_eager_activation(monkeypatch):
    monkeypatch.setenv("RESSERVE_FUSED_MLP", "1")
    _kernel_cases("cuda")
    _model_cases("cuda")


@pytest.mark.gpu
@triton_gpu
def test_gpu_fused_passes_give_the_eager_scores(monkeypatch):
    """The scores with the MLP activations, the RMSNorms and the loss fused, and all eager
    (`test_norm.assert_fused_scores_as_eager`: within 2e-4 relative)."""
    assert_fused_scores_as_eager(monkeypatch, ["RESSERVE_FUSED_MLP", "RESSERVE_FUSED_NORM", "RESSERVE_FUSED_LOSS"])
