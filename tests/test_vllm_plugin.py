"""The vLLM plugin's parts that run without vLLM: the entry point and the reference model."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from resserve_export.emulate import EmulatedLinear
from resserve_export.formats import qdq
from resserve_export.nvfp4 import global_scale
from resserve_export.vllm_plugin.reference import VllmArithmeticLinear, emulate_model, vllm_nvfp4_qdq


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the entry point without vLLM installed")
def test_register_without_vllm_imports_nothing():
    from resserve_export import vllm_plugin

    assert vllm_plugin.register() is None
    assert "resserve_export.vllm_plugin._register" not in sys.modules
    assert "resserve_export.vllm_plugin.method" not in sys.modules


def test_vllm_order_nvfp4_qdq_matches_spec_order_up_to_boundary_cases(gen):
    x = torch.randn(64, 256, generator=gen) * torch.rand(256, generator=gen) * 3
    alpha = global_scale(x.abs().amax() * 0.8)  # some blocks saturate, as with a calibrated amax
    ours, theirs = qdq(x, "nvfp4", alpha=alpha, backend="reference"), vllm_nvfp4_qdq(x, alpha)
    close = torch.isclose(ours, theirs, rtol=1e-6, atol=0)
    # The two operation orders round a value differently only when it sits within an ulp of an
    # E2M1 or E4M3 rounding boundary.
    assert close.float().mean() > 0.999


def test_vllm_order_nvfp4_qdq_zero_block_and_saturation():
    alpha = torch.tensor(1.0 / 2688.0)  # amax 1: block scales s = amax_block / 6
    x = torch.zeros(1, 32)
    x[0, 16:] = torch.linspace(-3.0, 3.0, 16)  # second block exceeds the calibrated amax
    out = vllm_nvfp4_qdq(x, alpha)
    assert torch.equal(out[0, :16], torch.zeros(16))
    # s = E4M3(2688 · 3/6) clamps to 448, so values saturate at 6 · 448 / 2688 = 1.
    assert float(out[0, 16:].abs().max()) == 1.0


def test_vllm_arithmetic_in_fp32_is_the_fp32_emulation_for_mxfp4(gen):
    lin = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64, generator=gen))
    x = torch.randn(5, 64, generator=gen)
    a = EmulatedLinear(lin, "mxfp4", input_amax=None)
    b = VllmArithmeticLinear(lin, "mxfp4", input_amax=None)
    assert torch.equal(a(x), b(x))


def test_emulate_model_replaces_every_quantized_linear_with_shared_group_scales(gen):
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(32, 32, bias=False) for _ in range(3))

    model = torch.nn.Module()
    model.self_attn = Attn()
    model.lm_head = torch.nn.Linear(32, 10, bias=False)
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    with torch.no_grad():
        for i, n in enumerate(names):
            model.get_submodule(n).weight.copy_(torch.randn(32, 32, generator=gen) * (i + 1))
    sal = {n: (torch.rand(32, generator=gen), torch.tensor(float(i + 2))) for i, n in enumerate(names)}
    with pytest.raises(ValueError, match="plain W4A4 only"):
        emulate_model(model, sal, "nvfp4", 0.25, arithmetic="vllm")
    emulate_model(model, sal, "nvfp4", 0.25)
    mods = [model.get_submodule(n) for n in names]
    assert all(isinstance(m, EmulatedLinear) for m in mods)
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, EmulatedLinear)
    # One decision for the fused group: the max input amax (4.0) and the max weight amax.
    assert all(float(m.input_alpha) == float(global_scale(torch.tensor(4.0))) for m in mods)
    assert len({float(m.qw.base.global_scale) for m in mods}) == 1
    assert all(torch.equal(m.qw.mask, mods[0].qw.mask) for m in mods)
