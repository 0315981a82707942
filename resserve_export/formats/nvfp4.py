"""NVFP4: 16-element blocks, E4M3 block scales, one FP32 tensor scale α (docs/formats.md, "NVFP4").

Operation order is fixed so that CPU, GPU, the CUDA kernel and ModelOpt 0.47's
``NVFP4QTensor.quantize`` agree bit for bit:
  α = amax / 2688.0                       (one FP32 division)
  s = amax_block / (6 · α)                (product first, in FP32); 0 -> 1.0; clamp [2^-9, 448]; E4M3 RNE
  code = E2M1(x / (float(s) · α))         (product first, then one FP32 division)
"""

from __future__ import annotations

from typing import Iterable

import torch

from resserve_export.formats.constants import F4_E2M1_MAX, F8_E4M3_MAX, F8_E4M3_MIN_SCALE, NVFP4_BLOCK, NVFP4_GLOBAL_DIVISOR
from resserve_export.formats.fp4 import decode_e2m1, encode_e2m1_packed, unpack_fp4


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """α = amax / 2688 as an FP32 scalar tensor (weights: tensor amax; activations: calibrated amax)."""
    amax = torch.as_tensor(amax).float()
    # Divide by a tensor, not a Python scalar: CUDA turns `t / scalar` into `t * (1/scalar)`,
    # which can differ from the IEEE division in the last bit.
    return amax / torch.tensor(NVFP4_GLOBAL_DIVISOR, dtype=torch.float32, device=amax.device)


def group_global_scale(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """The one α of a fused group (q/k/v, gate/up): `global_scale` of the max over members of amax(W).

    vLLM serves a fused group with a single ``weight_scale_2`` (the max of the members') and does
    not requantize, so every member is quantized with this α (docs/formats.md). `pack` writes it and
    `verify` recomputes it from the model, so both go through this function. Members are consumed
    one at a time (an iterable, so a caller can read them lazily) and each amax comes from one
    ``aminmax`` pass, without an |W| temporary. Float32 0-d on the CPU.
    """
    amax = torch.zeros((), dtype=torch.float32)
    for w in weights:
        lo, hi = torch.aminmax(w)
        amax = torch.maximum(amax, torch.maximum(-lo.float(), hi.float()).cpu())
    return global_scale(amax)


def block_scales(block_amax: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales from FP32 block amax and α.

    A zero scale becomes 1.0 (ModelOpt's rule). An all-zero block of an all-zero tensor (α = 0)
    gives 0/0 here; ModelOpt leaves that NaN (NaN scales, code 7), we give it 1.0 as well so an
    all-zero tensor dequantizes to zeros. Every other case, including NaN inputs, is unchanged.
    """
    block_amax = block_amax.float()
    s = block_amax / (F4_E2M1_MAX * alpha)
    s = torch.where((s == 0) | (block_amax == 0), torch.ones_like(s), s)
    return s.clamp(min=F8_E4M3_MIN_SCALE, max=F8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_blocks(xb: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``[..., n, 16]`` -> (packed codes ``[..., n, 8]``, E4M3 scales ``[..., n]``).

    Pure function of its inputs: it is the eager reference and the body that `torch.compile` fuses.
    """
    xf = xb.float()
    s = block_scales(xf.abs().amax(dim=-1), alpha)
    packed = encode_e2m1_packed(xf / (s.float() * alpha).unsqueeze(-1))
    return packed, s


def dequantize_blocks(packed: torch.Tensor, scales: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_blocks` in FP32: value · (float(s) · α)."""
    vals = decode_e2m1(unpack_fp4(packed))
    return vals * (scales.float() * alpha.float()).unsqueeze(-1)


BLOCK = NVFP4_BLOCK


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """amax(|x|) in x's dtype (0 for an empty tensor; NaN propagates).

    Equal to ``x.abs().amax()`` bit for bit, from one ``aminmax`` pass without materialising
    |x|: on a bf16 12288×4096 weight on CPU that is 0.004 s instead of 0.14 s.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(lo.abs(), hi.abs())
