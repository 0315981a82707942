"""How NVFP4 weight block scales are chosen: the min-max rule, or a per-block error search.

``minmax`` is the rule of `nvfp4.quantize_blocks` (bit-identical to ModelOpt 0.47): the E4M3
scale that maps the block's amax onto 6, rounded to nearest even. It is not the best scale: the
RNE step of E4M3 is 6–12 % of the scale, and a block whose amax is an outlier loses resolution
on every other element.

``mse`` keeps everything else (α, the E2M1 rounding of the codes, the encoding) and, for each
block, tries the E4M3 scales next to the min-max one, `MSE_STEPS_UP` representable values above
and `MSE_STEPS_DOWN` below it (clamped to [2^-9, 448]), keeping the one whose dequantized block
(`nvfp4.dequantize_blocks`) has the smallest squared error. Scales above the min-max one map the
block amax below 6, often onto 4, where the E2M1 grid is finer relative to the value (the gap
4→6 is the widest); scales below it clip the amax to buy resolution for the other values. The
min-max scale is tried first and only a strictly smaller error replaces it, so no block gets
worse than under ``minmax``, and an all-zero or non-finite block keeps its min-max scale. Every
block is chosen from its own 16 values and α, so quantizing ``[W | W_S]`` still gives the plain
quantization in its first columns. ModelOpt's MSE calibration with its FP8 scale sweep has the
same objective over all 126 E4M3 values; on SmolLM2's weights, probes 12 steps down and 10 up
found no block whose best scale lies outside this window.

Less weight error is not a better model. On SmolLM2-135M-Instruct's 210 decoder linears ``mse``
lowers the weight squared error by 30 % (every linear) and the output error on real activations
in 203 of them (pooled: 11 %), yet its fake-quantized perplexity on 2048 tokens is higher
(weights only 63.9 -> 65.2, weights and activations 74.0 -> 79.5; scaling α by 1 ± 2^-9 moves
these by 1-2 %). So ``minmax`` stays the default and ``mse`` is an option to evaluate per model.

The search is a scale choice only: checkpoints, the serving kernels and every dequantizer read
its output as any NVFP4 tensor. Activations are quantized at run time by the serving engine with
the min-max rule; this is for weights.
"""

from __future__ import annotations

from enum import Enum

import torch

from resserve_export.formats import nvfp4
from resserve_export.formats.fp4 import encode_e2m1_packed

# E4M3 representable values tried on each side of the min-max scale. Seven steps up stay below
# twice the scale (8 normal steps are one binade, and doubling the scale only leaves code 6
# unused); measured on SmolLM2-135M's decoder linears, no block picks a scale 8 or more steps
# up or more than 3 down, and the error pooled over all blocks stops falling at 2 down.
MSE_STEPS_DOWN = 3
MSE_STEPS_UP = 7

# Positive E4M3 bit patterns: 0x01 is 2^-9 (the clamp of `nvfp4.block_scales`), 0x7E is 448,
# 0x7F is NaN. Patterns 0x01..0x7E are ordered like the values they encode.
_E4M3_MIN_BITS = 0x01
_E4M3_MAX_BITS = 0x7E


class BlockScaleRule(str, Enum):
    """How a weight block's E4M3 scale is chosen (NVFP4); see the module docstring."""

    MINMAX = "minmax"
    MSE = "mse"

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"unknown block scale rule {value!r}, available: {[m.value for m in cls]}")


def step_scales(scales: torch.Tensor, step: int) -> torch.Tensor:
    """The E4M3 value `step` representable values above (step > 0) or below `scales`, clamped to
    [2^-9, 448]. Scales outside that range (NaN, zero, negative) are returned unchanged."""
    b = scales.view(torch.uint8).to(torch.int32)
    live = (b >= _E4M3_MIN_BITS) & (b <= _E4M3_MAX_BITS)
    moved = (b + step).clamp(_E4M3_MIN_BITS, _E4M3_MAX_BITS)
    return torch.where(live, moved, b).to(torch.uint8).view(torch.float8_e4m3fn)


def block_sse(xf: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Per-block squared error (float64) of the dequantized blocks against FP32 blocks `xf`.

    The dequantized value is exactly `nvfp4.dequantize_blocks`'s (FP32); the difference, its
    square and the 16-term sum are taken in float64, so that two candidates' errors compare the
    same wherever they are computed.
    """
    deq = nvfp4.dequantize_blocks(packed, scales, alpha)
    return (deq.double() - xf.double()).square().sum(dim=-1)


def _encode(xf: torch.Tensor, scales: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    # The same operation order as `nvfp4.quantize_blocks`: product first, then one FP32 division.
    return encode_e2m1_packed(xf / (scales.float() * alpha).unsqueeze(-1))


def _candidate_steps() -> tuple[int, ...]:
    """Candidate offsets in trial order: the min-max scale, then upwards, then downwards."""
    return (0, *range(1, MSE_STEPS_UP + 1), *(-k for k in range(1, MSE_STEPS_DOWN + 1)))


def quantize_blocks_mse(xb: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``[..., n, 16]`` -> (packed codes ``[..., n, 8]``, E4M3 scales ``[..., n]``) with
    the ``mse`` rule. Pure function of its inputs, like `nvfp4.quantize_blocks` (which it equals
    on every block where no other candidate is strictly better)."""
    xf = xb.float()
    s0 = nvfp4.block_scales(xf.abs().amax(dim=-1), alpha)
    best_codes = _encode(xf, s0, alpha)
    best_scales = s0
    best_err = block_sse(xf, best_codes, s0, alpha)
    for step in _candidate_steps()[1:]:
        s = step_scales(s0, step)
        codes = _encode(xf, s, alpha)
        err = block_sse(xf, codes, s, alpha)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
        best_scales = torch.where(better, s.view(torch.uint8), best_scales.view(torch.uint8)).view(torch.float8_e4m3fn)
    return best_codes, best_scales


def quantize_blocks(
    xb: torch.Tensor, alpha: torch.Tensor, rule: BlockScaleRule | str = BlockScaleRule.MINMAX
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 blocks quantized with block-scale rule `rule` (``minmax`` is `nvfp4.quantize_blocks`)."""
    if BlockScaleRule(rule) is BlockScaleRule.MINMAX:
        return nvfp4.quantize_blocks(xb, alpha)
    return quantize_blocks_mse(xb, alpha)


def blocks_fn(rule: BlockScaleRule | str):
    """``fn(blocks, alpha)`` of rule `rule`, for the compiled chunked path of `ops.quantize`."""
    return nvfp4.quantize_blocks if BlockScaleRule(rule) is BlockScaleRule.MINMAX else quantize_blocks_mse


def dequantize_blocks(packed: torch.Tensor, scales: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Every rule's output is an ordinary NVFP4 tensor: this is `nvfp4.dequantize_blocks`."""
    return nvfp4.dequantize_blocks(packed, scales, alpha)


__all__ = [
    "BlockScaleRule",
    "MSE_STEPS_DOWN",
    "MSE_STEPS_UP",
    "block_sse",
    "blocks_fn",
    "dequantize_blocks",
    "quantize_blocks",
    "quantize_blocks_mse",
    "step_scales",
]
