"""NVFP4 (docs/formats.md, "NVFP4"): bit-identical to ModelOpt 0.47 and readable by compressed-tensors."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from modelopt.torch.quantization.qtensor import NVFP4QTensor

from resserve_export.formats import ops as formats
from resserve_export.formats import nvfp4
from resserve_export.formats.fp4 import unpack_fp4

from tests.fixtures.tensors import bits

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("reference", "compiled")


def _tensor(kind: str, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Small [48, 256] test tensors; each kind stresses one part of the scale arithmetic."""
    shape = (48, 256)
    x = torch.randn(shape, generator=g)
    if kind == "normal":
        pass
    elif kind == "student_t":
        # heavy tails: Student-t with 2 dof, built from the generator (normal / sqrt(chi2/2))
        chi2 = torch.randn((*shape, 2), generator=g).pow(2).sum(-1)
        x = x / (chi2 / 2).sqrt()
    elif kind == "outliers":
        # a few huge outliers: most block scales fall to the 2^-9 clamp
        x[0, 0] = 3e4
        x[7, 100] = -1e4
        x[20:, :] *= 1e-4
    elif kind == "zero_blocks":
        x[3, 16:32] = 0  # one all-zero block in a row
        x[5] = 0  # an all-zero row
        x[9, ::2] = -0.0  # signed zeros inside live blocks
    elif kind == "tiny":
        # fp16 cannot hold 1e-30: use its subnormal range instead
        x = x * (1e-6 if dtype == torch.float16 else 1e-30)
    elif kind == "tiny_alpha_subnormal":
        # α = amax/2688 lands in the FP32 subnormal range
        x = x * (1e-7 if dtype == torch.float16 else 1e-36)
    elif kind == "huge":
        x = x * (1e4 if dtype == torch.float16 else 1e30)
    else:
        raise AssertionError(kind)
    return x.to(dtype)


KINDS = ("normal", "student_t", "outliers", "zero_blocks", "tiny", "tiny_alpha_subnormal", "huge")


def _modelopt(x: torch.Tensor):
    q, scales, alpha = NVFP4QTensor.quantize(x.clone(), 16)
    return q._quantized_data, scales, alpha


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_bit_identical_to_modelopt(kind, dtype, backend, gen):
    x = _tensor(kind, dtype, gen)
    assert torch.isfinite(x).all()
    codes, scales, alpha = _modelopt(x)
    q = formats.quantize(x, "nvfp4", backend=backend)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (48, 128)
    assert q.scales.dtype == torch.float8_e4m3fn and q.scales.shape == (48, 16)
    assert bits(q.global_scale).item() == bits(alpha.float().reshape(())).item()
    assert torch.equal(bits(q.scales), bits(scales)), "block scales differ"
    mismatches = (q.codes != codes).sum().item()
    assert mismatches == 0, f"{mismatches} code bytes differ from ModelOpt"


def test_fixtures_hit_the_edge_cases(gen):
    """The adversarial tensors above really reach the clamps they are meant to exercise."""
    x = _tensor("outliers", torch.float32, gen)
    q = formats.quantize(x, "nvfp4", backend="reference")
    assert (q.scales.float() == 2.0**-9).sum() > 100  # many blocks clamped to the smallest scale
    assert (q.scales.float() == 448.0).sum() == 1  # only the block holding the tensor amax
    alpha = formats.quantize(_tensor("tiny_alpha_subnormal", torch.float32, gen), "nvfp4").global_scale
    assert 0 < alpha.item() < torch.finfo(torch.float32).tiny
    z = formats.quantize(_tensor("zero_blocks", torch.float32, gen), "nvfp4")
    assert z.scales[3, 1].float().item() == 1.0  # all-zero block -> scale 1.0


def test_operation_order():
    """α = amax/2688, s = amax_b/(6α) cast to E4M3, code = E2M1(x/(s·α)): checked on one block."""
    x = torch.tensor([[7.0] + [0.3] * 15, [0.0] * 16], dtype=torch.float32)
    q = formats.quantize(x, "nvfp4", backend="reference")
    alpha = torch.tensor(7.0) / 2688.0
    assert q.global_scale.item() == alpha.item()
    assert q.scales[0, 0].float().item() == 448.0
    assert q.scales[1, 0].float().item() == 1.0
    # 0.3 / (448 · α) = 0.3 · 6 / 7 ≈ 0.257 -> code 1 (0.5); 7 -> 6 (code 7)
    assert unpack_fp4(q.codes)[0].tolist() == [7] + [1] * 15
    assert unpack_fp4(q.codes)[1].tolist() == [0] * 16


def test_all_zero_tensor_dequantizes_to_zero():
    # ModelOpt returns NaN block scales here (0/0); we keep docs/formats.md's "zero -> 1.0" instead.
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    q = formats.quantize(x, "nvfp4")
    assert q.global_scale.item() == 0.0
    assert torch.equal(q.scales.float(), torch.ones(4, 2))
    assert torch.equal(q.codes, torch.zeros(4, 16, dtype=torch.uint8))
    assert torch.equal(formats.dequantize(q), torch.zeros(4, 32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_abs_max_equals_abs_amax(dtype, gen):
    x = torch.randn(33, 70, generator=gen).to(dtype)
    assert bits(nvfp4.abs_max(x)) == bits(x.abs().amax())
    assert bits(nvfp4.abs_max(-x.abs())) == bits(x.abs().amax())  # amax on the negative side
    z = -torch.zeros(4, 16, dtype=dtype)
    assert bits(nvfp4.abs_max(z)) == bits(z.abs().amax())  # +0, not -0
    x[3, 4] = float("nan")
    assert torch.isnan(nvfp4.abs_max(x))
    assert nvfp4.abs_max(torch.empty(0, 16, dtype=dtype)).item() == 0.0


def test_nan_input_is_not_hidden():
    x = torch.randn(2, 16)
    x[0, 3] = float("nan")
    q = formats.quantize(x, "nvfp4", backend="reference")
    assert torch.isnan(formats.dequantize(q)).any()


def test_activation_alpha_given(gen):
    """Activations use the calibrated α, not the tensor's own amax; values above saturate."""
    x = torch.randn(8, 64, generator=gen)
    alpha = nvfp4.global_scale(torch.tensor(1.0))  # calibrated amax 1.0, below the real amax
    q = formats.quantize(x, "nvfp4", alpha=alpha, backend="reference")
    assert q.global_scale.item() == alpha.item()
    deq = formats.dequantize(q)
    assert deq.abs().max().item() <= 6 * 448 * alpha.item()
    assert (q.scales.float() == 448.0).any()
    ref = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=alpha.reshape(1))
    assert torch.equal(q.codes, ref[0]._quantized_data)
    assert torch.equal(bits(q.scales), bits(ref[1]))


def test_compiled_matches_reference_across_chunks(gen):
    """A tensor larger than one compiled chunk (16384 blocks) with a ragged tail."""
    x = torch.randn(16384 + 37, 16, generator=gen).bfloat16()
    a = formats.quantize(x, "nvfp4", backend="reference")
    b = formats.quantize(x, "nvfp4", backend="compiled")
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(bits(a.scales), bits(b.scales))


def test_batched_leading_dims(gen):
    x = torch.randn(2, 3, 64, generator=gen)
    q = formats.quantize(x, "nvfp4")
    flat = formats.quantize(x.reshape(6, 64), "nvfp4")
    assert q.codes.shape == (2, 3, 32) and q.scales.shape == (2, 3, 4)
    assert torch.equal(q.codes.reshape(6, 32), flat.codes)


def test_bad_width_raises():
    with pytest.raises(ValueError, match="multiple of the nvfp4 block size 16"):
        formats.quantize(torch.zeros(2, 24), "nvfp4")
    with pytest.raises(ValueError, match="available formats"):
        formats.quantize(torch.zeros(2, 32), "nvfp8")


# --- compressed-tensors reads our NVFP4 weights back -------------------------------------------


def _ct_decompress(q):
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    # compressed-tensors stores the reciprocal of ModelOpt's α as `weight_global_scale`.
    state = {
        "weight_packed": q.codes,
        "weight_scale": q.scales,
        "weight_global_scale": (1.0 / q.global_scale).reshape(1),
    }
    return NVFP4PackedCompressor.decompress(state, scheme)["weight"]


def test_compressed_tensors_decompressor_exact(gen):
    """α a power of two (amax = 2688·2^-10): 1/α is exact, so the decoded weights must be equal."""
    x = torch.randn(32, 128, generator=gen)
    x = (x / x.abs().max() * 2.625).bfloat16()  # amax 2.625 = 2688 / 1024, exact in bf16
    q = formats.quantize(x, "nvfp4")
    assert q.global_scale.item() == 2.0**-10
    theirs = _ct_decompress(q)
    assert theirs.dtype == torch.bfloat16
    ours = formats.dequantize(q)
    assert torch.equal(ours.bfloat16().float(), ours)  # FP4 · E4M3 · 2^k is exact in bf16
    assert torch.equal(theirs.float(), ours)


def test_compressed_tensors_decompressor_general(gen):
    """Any α: compressed-tensors divides by 1/α, we multiply by α; at most one bf16 step apart."""
    x = torch.randn(32, 128, generator=gen).bfloat16()
    q = formats.quantize(x, "nvfp4")
    theirs = _ct_decompress(q).float()
    ours = formats.dequantize(q)
    assert torch.equal(theirs == 0, ours == 0)
    rel = ((theirs - ours).abs() / ours.abs().clamp_min(1e-30)).max().item()
    assert rel <= 2.0**-8
    # and the dominant case is exact equality
    assert (theirs == ours.bfloat16().float()).float().mean().item() > 0.99
