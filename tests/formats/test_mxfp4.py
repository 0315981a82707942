"""MXFP4 (docs/formats.md, "MXFP4"): ModelOpt's ceil rule, compressed-tensors' even rule, the OCP floor rule."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from modelopt.torch.quantization.qtensor import MXFP4QTensor

from resserve_export.formats import ops as formats
from resserve_export.formats import mxfp4
from resserve_export.formats.fp4 import unpack_fp4
from resserve_export.formats.mxfp4 import ScaleRounding

from tests.fixtures.tensors import bits


def _data(kind: str, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(64, 512, generator=g)
    if kind == "student_t":
        chi2 = torch.randn((64, 512, 2), generator=g).pow(2).sum(-1)
        x = x / (chi2 / 2).sqrt()
    elif kind == "tiny":
        x = x * (1e-6 if dtype == torch.float16 else 1e-37)  # FP32 subnormal amax/6 and scales 2^-127
    elif kind == "huge":
        x = x * (1e4 if dtype == torch.float16 else 1e37)
    elif kind == "zero_blocks":
        x[1, 32:64] = 0
        x[2] = 0
    return x.to(dtype)


def _modelopt_dequant(x: torch.Tensor):
    q, e8m0 = MXFP4QTensor.quantize(x.clone(), 32)
    deq = q.dequantize(dtype=torch.float32, scale=e8m0, block_sizes={-1: 32})
    return deq, e8m0.reshape(x.shape[0], -1)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("kind", ("normal", "student_t", "tiny", "huge", "zero_blocks"))
def test_ceil_matches_modelopt_except_ties(kind, dtype, gen):
    x = _data(kind, dtype, gen)
    theirs, their_scales = _modelopt_dequant(x)
    q = formats.quantize(x, "mxfp4", rounding="ceil", backend="reference")
    ours = formats.dequantize(q)
    # Same block exponents (ModelOpt's log2 only goes wrong just above a power of two, see below).
    assert torch.equal(q.scales, their_scales)

    scaled = (x.float().reshape(64, -1, 32) / mxfp4.exp2_exact(q.scales.int() - 127)[..., None]).reshape(x.shape)
    mag = scaled.abs()
    # ModelOpt rounds every tie toward zero; we round ties to even, so we differ exactly at the
    # three midpoints whose even neighbour is the larger one.
    tie_up = (mag == 0.75) | (mag == 1.75) | (mag == 3.5)
    tie_down = (mag == 0.25) | (mag == 1.25) | (mag == 2.5) | (mag == 5.0)
    value_mismatch = theirs != ours  # -0.0 == +0.0 here
    assert torch.equal(value_mismatch, tie_up), (
        f"{value_mismatch.sum().item()} value mismatches vs {tie_up.sum().item()} tie-up elements"
    )
    assert not (value_mismatch & tie_down).any()
    # Where values agree, bit patterns differ only by the sign of zero: ModelOpt writes +0 as -0.
    sign_only = (bits(theirs) != bits(ours)) & ~value_mismatch
    assert (ours[sign_only] == 0).all()
    assert torch.equal(sign_only, (ours == 0) & (bits(ours) != bits(theirs)))
    if dtype == torch.bfloat16 and kind == "normal":
        # bf16 has 8 significant bits, so ties are common: the comparison above really counted some.
        assert tie_up.sum().item() > 50 and tie_down.sum().item() > 50
    if kind == "zero_blocks":
        assert sign_only.sum().item() >= 512 + 32  # the zero row and the zero block


def test_modelopt_log2_lands_one_too_low_just_above_a_power_of_two():
    """amax/6 = 2^10·(1 + 2^-23): ModelOpt's ceil(log2(·)) in FP32 rounds log2 to exactly 10.0, so
    it picks 2^10 < amax/6 and the block's largest element saturates. The exact rule picks 2^11."""
    amax = (6.0 + 2.0**-21) * 2.0**10
    assert (torch.tensor(amax, dtype=torch.float32) / 6).item() == 2.0**10 * (1 + 2.0**-23)
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    x[0, 1] = 2.0**10 * 0.75  # representable exactly with 2^10, rounds at 2^11
    _, their_scales = _modelopt_dequant(x)
    q = formats.quantize(x, "mxfp4", rounding="ceil")
    assert their_scales.item() - 127 == 10  # one too low: 2^10 < amax/6
    assert q.scales.item() - 127 == 11  # smallest e with 2^e >= amax/6
    # Exhaustively over exponents: the exact rule never lands below amax/6, ModelOpt does often.
    ks = torch.arange(-100, 100, dtype=torch.float32)
    amaxes = (6.0 + 2.0**-21) * torch.exp2(ks)
    ours = mxfp4.scale_exponent(amaxes, ScaleRounding.CEIL)
    assert (mxfp4.exp2_exact(ours) >= amaxes / 6).all()
    assert (mxfp4.exp2_exact(ours - 1) < amaxes / 6).all()
    modelopt = torch.ceil(torch.log2(amaxes / 6)).int()
    assert (modelopt == ours - 1).sum().item() > 150


@pytest.mark.parametrize(
    "amax, e",
    [
        (6.0, 0),  # exactly representable: 6 = 6 · 2^0
        (6.000001, 1),
        (3.0, -1),
        (3.1, 0),
        (0.75, -3),
        (1e-45, -127),  # smallest subnormal: clamped
        (0.0, -127),
        (6 * 2.0**-127, -127),
        (6 * 2.0**-126, -126),
        (6 * 2.0**127, 127),
        (3.4e38, 126),
    ],
)
def test_ceil_exponent_hand_cases(amax, e):
    assert mxfp4.scale_exponent(torch.tensor([amax]), "ceil").item() == e


@pytest.mark.parametrize(
    "amax, e",
    [  # OCP MX v1.0 §6.3: X = 2^(floor(log2 amax) − emax_elem), emax_elem = 2 for E2M1
        (6.0, 0),
        (7.99, 0),  # 7.99 / 1 saturates to 6
        (8.0, 1),
        (4.0, 0),
        (3.99, -1),
        (1.0, -2),
        (0.0, -127),
        (2.0**-126, -127),  # -128 clamped to the E8M0 range
        (2.0**-124, -126),
        (3.4e38, 125),
    ],
)
def test_floor_exponent_hand_cases(amax, e):
    assert mxfp4.scale_exponent(torch.tensor([amax]), "floor").item() == e


def test_floor_saturates_and_rounds():
    # amax 7.9: scale 2^0, so 7.9 -> 6 (saturated), 5 -> 4 (tie to even), 0.75 -> 1 (tie to even)
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([7.9, 5.0, -0.75, 2.9])
    q = formats.quantize(x, "mxfp4", rounding="floor")
    assert q.scales.item() == 127
    assert unpack_fp4(q.codes)[0, :4].tolist() == [0b0111, 0b0110, 0b1010, 0b0101]
    assert formats.dequantize(q)[0, :4].tolist() == [6.0, 4.0, -1.0, 3.0]
    # ceil never saturates: the same block gets 2^1 and 7.9 -> 4 (3.95 rounds to 4)
    c = formats.quantize(x, "mxfp4", rounding="ceil")
    assert c.scales.item() == 128
    assert formats.dequantize(c)[0, 0].item() == 8.0


@pytest.mark.parametrize(
    "amax, e",
    [  # round amax to a power of two (up from mantissa 1.75), then floor rule
        (1.74, -2),
        (1.75, -1),
        (6.0, 0),  # 6 = 1.5 · 2^2 stays at 2^2
        (7.0, 1),  # 7 = 1.75 · 2^2 rounds up to 2^3
        (0.0, -127),
    ],
)
def test_even_exponent_hand_cases(amax, e):
    assert mxfp4.scale_exponent(torch.tensor([amax]), "even").item() == e


# --- compressed-tensors' MXFP4 compressor ------------------------------------------------------


def _ct_mxfp4(x: torch.Tensor):
    scheme = preset_name_to_scheme("MXFP4", ["Linear"])
    groups = x.reshape(x.shape[0], -1, 32)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    out = MXFP4PackedCompressor.compress({"weight": x, "weight_scale": scale}, scheme)
    return out["weight_packed"], out["weight_scale"]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("kind", ("normal", "student_t", "zero_blocks", "power_of_two_edges"))
def test_even_bit_identical_to_compressed_tensors(kind, dtype, gen):
    if kind == "power_of_two_edges":
        x = torch.rand(64, 512, generator=gen) * 2 - 1
        # block amax exactly at and just below the 1.75·2^k rounding edge, at many k
        k = torch.randint(-20, 20, (64, 16), generator=gen).float()
        edge = torch.where(torch.rand(64, 16, generator=gen) < 0.5, 1.75, 1.7421875)
        x = x.reshape(64, 16, 32) * 0.5
        x[..., 0] = edge * torch.exp2(k)
        x[..., 1:] *= torch.exp2(k)[..., None]
        x = x.reshape(64, 512)
    else:
        x = _data(kind, dtype, gen)
    x = x.to(dtype)
    packed, scales = _ct_mxfp4(x)
    q = formats.quantize(x, "mxfp4", rounding="even")
    assert scales.dtype == torch.uint8
    assert torch.equal(q.scales, scales)
    assert torch.equal(q.codes, packed), f"{(q.codes != packed).sum().item()} code bytes differ"


@pytest.mark.parametrize("rounding", list(ScaleRounding))
def test_compiled_matches_reference(rounding, gen):
    x = torch.randn(40, 1024, generator=gen) * torch.exp2(torch.randint(-130, 120, (40, 1), generator=gen).float())
    x = x.float()
    a = formats.quantize(x, "mxfp4", rounding=rounding, backend="reference")
    b = formats.quantize(x, "mxfp4", rounding=rounding, backend="compiled")
    assert torch.equal(a.scales, b.scales)
    assert torch.equal(a.codes, b.codes)


def test_exp2_exact():
    e = torch.arange(-127, 128)
    assert torch.equal(mxfp4.exp2_exact(e), torch.exp2(e.double()).float())


def test_unknown_rounding_lists_choices():
    with pytest.raises(ValueError, match=r"available: \['ceil', 'floor', 'even'\]"):
        formats.quantize(torch.zeros(1, 32), "mxfp4", rounding="nearest")
