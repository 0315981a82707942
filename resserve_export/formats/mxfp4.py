"""MXFP4: 32-element blocks, E8M0 (power-of-two) scales, no tensor scale (docs/formats.md, "MXFP4").

The scale exponent rule is explicit (`ScaleRounding`) and recorded in checkpoints. All three
rules are computed exactly from the FP32 bit pattern, never through ``log2``.
"""

from __future__ import annotations

from enum import Enum

import torch

from resserve_export.formats.constants import E8M0_BIAS, E8M0_MAX_EXP, E8M0_MIN_EXP, F4_E2M1_MAX, F4_E2M1_MAX_POW2, MXFP4_BLOCK
from resserve_export.formats.fp4 import decode_e2m1, encode_e2m1_packed, unpack_fp4

_EXP_MASK = 0x7F800000
_MANT_BITS = 23


class ScaleRounding(str, Enum):
    """How a block's E8M0 exponent is derived from its amax.

    CEIL:  smallest e with 2^e >= amax/6 (ModelOpt's rule; never saturates). ModelOpt computes it
           through ``ceil(log2(amax/6))``, which can land one too low just above a power of two;
           we compute it exactly from the FP32 exponent and mantissa.
    FLOOR: floor(log2 amax) - 2 (OCP Microscaling Formats v1.0, §6.3); large values may saturate.
    EVEN:  amax rounded to a power of two first (up when its mantissa is >= 1.75, the
           compressed-tensors rule for an E2M1 element), then the FLOOR rule.
    """

    CEIL = "ceil"
    FLOOR = "floor"
    EVEN = "even"

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"unknown MXFP4 scale rounding {value!r}, available: {[m.value for m in cls]}")


def _exp_field(v: torch.Tensor) -> torch.Tensor:
    return (v.float().contiguous().view(torch.int32) & _EXP_MASK) >> _MANT_BITS


def scale_exponent(block_amax: torch.Tensor, rounding: ScaleRounding = ScaleRounding.CEIL) -> torch.Tensor:
    """Unbiased int32 exponents e, clamped to [-127, 127], one per block amax."""
    rounding = ScaleRounding(rounding)
    amax = block_amax.float()
    if rounding is ScaleRounding.CEIL:
        # A tensor divisor keeps CUDA from multiplying by a rounded reciprocal (see nvfp4.global_scale).
        v = (amax / torch.tensor(F4_E2M1_MAX, dtype=torch.float32, device=amax.device)).contiguous()
        bits = v.view(torch.int32)
        field = (bits & _EXP_MASK) >> _MANT_BITS
        mant = bits & ((1 << _MANT_BITS) - 1)
        normal = field - 127 + (mant != 0).to(torch.int32)
        # Subnormal v (< 2^-126): the answer is -126 when v > 2^-127, otherwise at most -127.
        sub = torch.where(mant > (1 << (_MANT_BITS - 1)), -126, E8M0_MIN_EXP).to(torch.int32)
        e = torch.where(field == 0, sub, normal)
    elif rounding is ScaleRounding.FLOOR:
        e = _exp_field(amax) - 127 - F4_E2M1_MAX_POW2
    else:  # EVEN
        bits = amax.contiguous().view(torch.int32)
        rounded = ((bits + (1 << (_MANT_BITS - 2))) & _EXP_MASK) >> _MANT_BITS
        e = rounded - 127 - F4_E2M1_MAX_POW2
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def exp2_exact(e: torch.Tensor) -> torch.Tensor:
    """2^e as FP32 for integer e in [-127, 127], built from bits (2^-127 is subnormal)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << _MANT_BITS).view(torch.float32)
    return torch.where(e == -127, torch.full_like(normal, 2.0**-127), normal)


def quantize_blocks(
    xb: torch.Tensor, rounding: ScaleRounding = ScaleRounding.CEIL
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``[..., n, 32]`` -> (packed codes ``[..., n, 16]``, uint8 E8M0 scales ``[..., n]``)."""
    xf = xb.float()
    e = scale_exponent(xf.abs().amax(dim=-1), rounding)
    packed = encode_e2m1_packed(xf / exp2_exact(e).unsqueeze(-1))
    return packed, (e + E8M0_BIAS).to(torch.uint8)


def dequantize_blocks(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    vals = decode_e2m1(unpack_fp4(packed))
    return vals * exp2_exact(scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1)


BLOCK = MXFP4_BLOCK
