"""The vLLM plugin's parts that run without vLLM: the entry point and the reference model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from resserve_export.algorithms.emulate import EmulatedLinear
from resserve_export.formats.ops import qdq
from resserve_export.formats.nvfp4 import global_scale

# The reference models of vLLM's arithmetic are test code (tests/vllm_scripts/), not the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_scripts"))
from reference import VllmArithmeticLinear, emulate_model, vllm_nvfp4_qdq  # noqa: E402


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


def _fp32_round(x) -> float:
    """The FP32 value nearest to the rational `x` (ties to even)."""
    from fractions import Fraction

    import numpy as np

    f = np.float32(float(x))
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    dist = [abs(Fraction(float(c)) - x) for c in cands]
    best = min(dist)
    ties = [c for c, d in zip(cands, dist) if d == best]
    return float(min(ties, key=lambda c: int(np.array(c).view(np.int32)) & 1))


def test_cpu_attention_fma_is_correctly_rounded(gen):
    from fractions import Fraction

    from cpu_attention import fma

    a = torch.randn(2000, generator=gen) * 2.0 ** torch.randint(-8, 8, (2000,), generator=gen)
    b = torch.randn(2000, generator=gen)
    c = -(a * b) * (1 + torch.randn(2000, generator=gen) * 1e-3)  # heavy cancellation
    c[::2] = torch.randn(1000, generator=gen)
    # a·b = 2^-24 (1 + 2^-36): 1 + a·b lies just above the FP32 tie 1 + 2^-24, so the correct
    # result is 1 + 2^-23, but FP64 first rounds to the tie and then to even, 1.
    a = torch.cat([a, torch.tensor([2.0**-24 * (1 + 2.0**-12)])])
    b = torch.cat([b, torch.tensor([1 - 4095 * 2.0**-24])])
    c = torch.cat([c, torch.tensor([1.0])])
    assert float((a[-1].double() * b[-1].double() + 1.0).float()) == 1.0
    got = fma(a, b, c)
    want = [_fp32_round(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) for x, y, z in zip(a, b, c)]
    assert want[-1] == 1 + 2.0**-23
    assert torch.equal(got, torch.tensor(want, dtype=torch.float32))


def test_cpu_attention_exp_rotary_and_attention_are_close_to_exact(gen):
    import math

    import torch.nn.functional as F

    from cpu_attention import attention, fast_exp, rotary

    x = torch.linspace(-86.0, 0.0, 10001)  # (near ln FLT_MIN the kernel flushes to 0 early)
    assert float(((fast_exp(x) - x.double().exp()) / x.double().exp()).abs().max()) < 1e-6
    assert float(fast_exp(torch.tensor([float("-inf"), -200.0])).abs().max()) == 0.0
    q = torch.randn(6, 5, 64, generator=gen)
    ang = torch.rand(5, 32, generator=gen) * 6
    rot = rotary(q, ang.cos(), ang.sin())
    x1, x2 = q[..., :32], q[..., 32:]
    assert torch.allclose(rot, torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1), atol=1e-6)
    q, k, v = (torch.randn(h, 40, 64, generator=gen) for h in (6, 2, 2))
    for tq in (40, 1):  # a prefill, a decode step against a cache of 39 earlier positions
        mask = torch.ones(tq, 40, dtype=torch.bool).tril(40 - tq)
        want = F.scaled_dot_product_attention(q[:, -tq:][None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
        got = attention(q[:, -tq:], k, v, 1 / math.sqrt(64))
        assert torch.allclose(got, want, atol=2e-6)


def test_cpu_engine_attention_swaps_into_an_hf_llama_with_its_kv_cache(gen):
    from transformers import LlamaConfig, LlamaForCausalLM

    from cpu_attention import CpuEngineAttention, use_cpu_engine_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    hf = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (1, 12), generator=gen)
    with torch.no_grad():
        want = hf(ids).logits
        use_cpu_engine_attention(hf)
        assert all(isinstance(layer.self_attn, CpuEngineAttention) for layer in hf.model.layers)
        full = hf(ids).logits
        out = hf(ids[:, :9], use_cache=True)
        steps = [out.logits]
        for t in range(9, 12):
            out = hf(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    assert torch.allclose(full, want, atol=1e-5)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    with pytest.raises(ValueError, match="FP32"):
        hf.to(torch.bfloat16)(ids)
