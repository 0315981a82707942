"""The fused quantize-and-extend kernel's CPU side (docs/formats.md, "The fused quantize-and-extend kernel"): the wrapper's reference path, its
argument checks, and the kernel's two E2M1 rounding rules (re-stated in Python) against
`fp4.encode_e2m1`: the exact path's integer rule and the fast path's one-binade magic-number rule.
The kernel itself on a GPU: tests/kernels/test_quantize_extend_cuda.py."""

from __future__ import annotations

import pytest
import torch

from resserve_export.algorithms import kernel
from resserve_export.algorithms import kext
from resserve_export.formats.fp4 import encode_e2m1
from resserve_export.formats.nvfp4 import global_scale

from tests.fixtures.kernel_inputs import adversarial, random_mask



def kernel_e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """The kernel's integer rounding rule (quantize_extend.cu, e2m1_magnitude), in torch."""
    a = a.float()
    low = torch.round(a * 2.0).to(torch.int64)  # round() is half-to-even, like cvt.rni
    u = a.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = ((u + 0x1FFFFF + ((u >> 22) & 1)) >> 22) - 252
    return torch.where(a >= 1.0, high.clamp(max=7), low)


def test_kernel_e2m1_rule_matches_reference_on_every_tie_and_a_dense_sweep():
    ties = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, float("inf")])
    # tie to even: 0.25->0, 0.75->1 (code 2), 1.25->1 (2), 1.75->2 (4), 2.5->2 (4), 3.5->4 (6), 5->4 (6)
    assert kernel_e2m1_magnitude(ties).tolist() == [0, 0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7]
    sweep = torch.cat([torch.linspace(0, 8, 200_001), torch.rand(100_000) * 1e-3, torch.rand(100_000) * 100])
    # every neighbour of every tie, one FP32 ulp either side
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0, 0.5, 6.0])
    near = torch.cat([torch.nextafter(t, torch.zeros_like(t)), torch.nextafter(t, torch.full_like(t, 9.0)), t])
    a = torch.cat([sweep, near])
    assert torch.equal(kernel_e2m1_magnitude(a), encode_e2m1(a).to(torch.int64))


def kernel_e2m1_fast(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast path's rule (quantize_extend.cu, e2m1_sum, e2m1_nibble, e2m1_value), in torch:
    a = min(|q|, 6), p = the power of two of max(a, 1), g = a + (1.5*2^22 + 1)*p in FP32 (one
    rounding: the product is exact); nibble = (mulhi(bits(g), 2^32 - 3*2^10) & 7) | sign of q in
    bit 3; v = g - float(bits(g) & 0xFF800000) * (1.5 + 2^-22). Returns (nibble, v)."""
    q = q.float() + 0.0  # the kernel's quotients are never -0 (its division maps x = -0 to +0)
    a = torch.clamp(q.abs(), max=6.0)
    p = (torch.clamp(a, min=1.0).view(torch.int32) & 0x7F800000).view(torch.float32)
    g = a + p * 6291457.0
    gb = g.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    code = ((gb * 0xFFFFF400) >> 32) & 7
    qs = (q.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) >> 28
    h = (g.view(torch.int32) & 0xFF800000).view(torch.float32)
    v = g - h * (1.5 + 2.0**-22)
    assert torch.equal(v, g - p * 6291457.0)  # the full-compensation path's form, same values
    return code | (qs & 8), v


def test_kernel_fast_e2m1_rule_matches_reference_on_every_tie_and_a_dense_sweep():
    ties = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, float("inf"), 1e-45, 2.0**-126])
    code, v = kernel_e2m1_fast(ties)
    assert code.tolist() == [0, 0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7, 0, 0]
    assert v.tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, 0.0, 0.0]
    sweep = torch.cat([torch.linspace(0, 8, 400_001), torch.rand(100_000) * 1e-3, torch.rand(100_000) * 100])
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0, 0.5, 2.0, 4.0, 6.0])
    near = torch.cat([torch.nextafter(t, torch.zeros_like(t)), torch.nextafter(t, torch.full_like(t, 9.0)), t])
    a = torch.cat([sweep, near, -sweep])
    code, v = kernel_e2m1_fast(a)
    want = encode_e2m1(a).to(torch.int64)  # with the sign: -0 only for negative quotients
    assert torch.equal(code, want)
    assert torch.equal(v, torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[want & 7])


def test_reference_backend_is_extended_activation():
    gen = torch.Generator().manual_seed(0)
    x = adversarial(6, 256, torch.bfloat16, gen).reshape(2, 3, 256)
    mask = random_mask(256, 2, gen)
    alpha = global_scale(torch.tensor(3.0))
    got = kernel.quantize_extend(x, mask, 0.25, "nvfp4", alpha=alpha, backend="reference")
    want = kext.extended_activation(x, mask, 0.25, "nvfp4", alpha=alpha)
    assert got.shape == (2, 3, 256 + kext.ext_width(256, 0.25, "nvfp4")) == (2, 3, 320)
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    base, res = kernel.quantize_full(x, "mxfp4", rounding="floor", backend="reference")
    wb, wr = kext.full_residue(x, "mxfp4", rounding="floor")
    assert torch.equal(base.codes, wb.codes) and torch.equal(res.scales, wr.scales)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_reference_backend_on_large_cpu_tensors_takes_the_compiled_path_bit_exactly(fmt):
    gen = torch.Generator().manual_seed(5)
    x = adversarial(520, 1024, torch.bfloat16, gen)  # over formats' compiled-path threshold
    mask = random_mask(1024, 4, gen)
    got = kernel.quantize_extend(x, mask, 0.5, fmt, backend="reference")
    want = kext.extended_activation(x, mask, 0.5, fmt, alpha=kernel._alpha(x, None) if fmt == "nvfp4" else None)
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    b, r = kernel.quantize_full(x, fmt, backend="reference")
    wb, wr = kext.full_residue(x, fmt, alpha=want.global_scale)
    assert torch.equal(r.codes, wr.codes) and torch.equal(r.scales.view(torch.uint8), wr.scales.view(torch.uint8))


def test_auto_uses_the_reference_for_cpu_tensors():
    assert kernel.backend_for(torch.zeros(4, 32, dtype=torch.bfloat16)) == "reference"


@pytest.mark.skipif(kernel.KERNEL_AVAILABLE, reason="the kernel can run here")
def test_cuda_backend_without_gpu_says_what_is_needed():
    with pytest.raises(kernel.KernelUnavailable, match="CUDA"):
        kernel.quantize_extend(torch.zeros(2, 32, dtype=torch.bfloat16), None, 0.0, "nvfp4", backend="cuda")


def test_kernel_sources_are_found():
    d = kernel.kernels_dir()
    assert d is not None and (d / "quantize_extend.cu").is_file()


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="available"):
        kernel.quantize_extend(torch.zeros(2, 32), None, 0.0, "nvfp4", backend="triton")


def test_mask_check_counts_bits_only_when_asked():
    """`quantize_extend(check_mask=False)` (the grad scores' masks, checked when built) skips the
    bit count, a GPU sync per launch; the shape and dtype checks stay."""
    wrong = torch.full((32,), 0b11, dtype=torch.uint8)  # two channels per group
    with pytest.raises(ValueError, match="exactly 1"):
        kernel._check_mask(wrong, 256, 1, torch.device("cpu"))
    assert torch.equal(kernel._check_mask(wrong, 256, 1, torch.device("cpu"), count=False), wrong)
    assert torch.equal(kernel._check_mask(wrong.reshape(4, 8), 256, 2, torch.device("cpu")), wrong)
    with pytest.raises(ValueError, match="uint8"):
        kernel._check_mask(wrong[:31], 256, 2, torch.device("cpu"), count=False)


@pytest.mark.parametrize("fmt,rounding", [("nvfp4", "ceil"), ("mxfp4", "ceil"), ("mxfp4", "floor"), ("mxfp4", "even")])
def test_every_extension_in_one_quantization_is_each_ratio_alone(fmt, rounding):
    """`kernel.extend_weights` (the candidates' build: all K-Ext ratios in one gather and one
    quantization) gives each ratio's `kext.extend_weight` codes and scale bytes in its column
    block, -0 and all-zero blocks included; plain and full ratios have no block."""
    from resserve_export.formats import registry

    gen = torch.Generator().manual_seed(7)
    w = adversarial(96, 512, torch.bfloat16, gen)
    w[:4, :64] = -1e-30  # blocks that quantize to -0
    w[4:6] = 0.0
    f = registry.get(fmt)
    alpha = f.weight_alpha([w])
    ratios = [0.125, 0.25, 0.5]
    masks = [random_mask(512, k, gen) for k in (1, 2, 4)]
    every, offsets = kernel.extend_weights(w, masks, ratios, fmt, rounding, alpha=alpha)
    assert every.shape == (96, sum(kext.ext_width(512, r, fmt) for r in ratios))
    for ratio, mask, o in zip(ratios, masks, offsets):
        want = kext.extend_weight(w, mask, ratio, fmt, rounding, alpha=alpha)
        n = want.shape[-1]
        assert torch.equal(every.codes[:, o // 2 : (o + n) // 2], want.codes)
        assert torch.equal(every.scales.view(torch.uint8)[:, o // f.block : (o + n) // f.block], want.scales.view(torch.uint8))
    none, offsets = kernel.extend_weights(w, [None, None], [0.0, 1.0], fmt, rounding, alpha=alpha)
    assert none is None and offsets == [0, 0]


def test_prepare_operands_passes_the_kernel_its_ratio_codes(monkeypatch):
    """`kernel.prepare_operands`' wrapper (its launches are the GPU test's): partial ratios go to
    the extension as the channels they select per group of 8, full compensation as 8, a missing
    mask as the empty spare; plain is refused, since it has no residue operand."""
    seen = {}

    class Fake:
        def prepare_operands(self, x, masks, ksels, widths, alpha, factors, fmt, rounding, rows, max_ctas):
            seen.update(masks=masks, ksels=ksels, widths=widths, alpha=alpha, fmt=fmt, rounding=rounding)
            return ["ops"]

    monkeypatch.setattr(kernel, "_extension", lambda: Fake())
    monkeypatch.setattr(kernel, "default_max_ctas", lambda index: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x, m = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.uint8)
    factors = torch.zeros(256)
    assert kernel.prepare_operands(x, [m, m, m, None], [0.125, 0.25, 0.5, 1.0], [16, 16, 32, 0], "mxfp4", None, "floor", factors) == ["ops"]
    assert seen["ksels"] == [1, 2, 4, 8] and seen["widths"] == [16, 16, 32, 0]
    assert seen["masks"][:3] == [m, m, m] and seen["masks"][3].numel() == 0
    assert seen["fmt"] == 1 and seen["rounding"] == 1 and seen["alpha"].shape == ()
    with pytest.raises(ValueError, match="only compensated ratios"):
        kernel.prepare_operands(x, [None], [0.0], [0], "nvfp4", None, "ceil", factors)
