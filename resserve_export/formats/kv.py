"""KV-cache formats: the kinds a checkpoint can declare, the scales it stores for them and
the quantize-dequantize that emulates them.

Scales. vLLM quantizes a cached key as ``k / k_scale`` and dequantizes by multiplying with
``k_scale``. FP8 (E4M3): ``k_scale = amax / 448`` maps the calibrated amax to E4M3's largest
finite value (values beyond it saturate). NVFP4 KV uses the same scale, ``amax / 448``: that is
ModelOpt's convention (``modelopt/torch/export/unified_export_hf.py``: "We define kv cache scale
as amax / 448 for both FP8 and NVFP4 KV cache quantization"). The cache then holds
``k / k_scale`` in NVFP4 blocks of 16 along the head dimension, each with an E4M3 block scale
(block amax / 6), i.e. NVFP4 with the tensor scale alpha = ``k_scale``.

Tensor names follow the checkpoint format's producer: ModelOpt writes
``....self_attn.k_proj.k_scale`` / ``....self_attn.v_proj.v_scale`` (0-d float32),
compressed-tensors ``....self_attn.k_scale`` / ``....self_attn.v_scale`` (shape [1], float32); vLLM
maps both onto its attention layers' ``attn.k_scale`` / ``attn.v_scale``."""

from __future__ import annotations

import torch

from resserve_export.core.errors import UserError
from resserve_export.formats import registry

KINDS = ("none", "fp8", "nvfp4")


FP8_MAX = 448.0  # E4M3's largest finite value


SCALE_DIVISOR = 448.0  # scale = amax / 448, for FP8 and NVFP4 alike (ModelOpt's convention)


NVFP4_KV_BLOCK = 16


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UserError(f"unknown --kv-cache {kind!r}: choose one of {', '.join(KINDS)}")
    return kind


def check_for_format(kind: str, fmt) -> str:
    """`kind` checked, and supported by checkpoint format `fmt` (its loaders read those scales);
    a one-line `UserError` otherwise."""

    f = registry.get(fmt)
    try:
        f.check_kv(check_kind(kind))
    except ValueError as e:
        raise UserError(f"{e} (what their vLLM loader reads): choose --kv-cache {' or '.join(f.kv_kinds)}, or --format nvfp4") from None
    return kind


def scale_names(attn: str, style: str) -> tuple[str, str]:
    """(k_scale name, v_scale name) of attention module `attn` in a checkpoint: ``style`` is
    ``"modelopt"`` or ``"compressed-tensors"``."""
    if style == "modelopt":
        return f"{attn}.k_proj.k_scale", f"{attn}.v_proj.v_scale"
    return f"{attn}.k_scale", f"{attn}.v_scale"


def scale_shape(style: str) -> tuple[int, ...]:
    return () if style == "modelopt" else (1,)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The stored KV scale (float32) of a calibrated amax: amax / 448."""
    return (torch.as_tensor(amax, dtype=torch.float32).reshape(()) / SCALE_DIVISOR).float()


def kv_qdq(x: torch.Tensor, scale: torch.Tensor | float, kind: str) -> torch.Tensor:
    """Keys or values `x` (last dim = head dim) after the KV cache's quantize-dequantize with
    the per-tensor `scale`, in x's dtype. FP8: E4M3 of ``x / scale`` (round to nearest even,
    saturating at ±448). NVFP4: NVFP4 blocks of 16 along the head dim with α = scale."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    if kind == "fp8":
        q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (q.float() * s).to(x.dtype)
    if kind == "nvfp4":
        from resserve_export.formats import nvfp4

        if x.shape[-1] % NVFP4_KV_BLOCK:
            raise UserError(f"head dimension {x.shape[-1]} is not a multiple of {NVFP4_KV_BLOCK}: NVFP4 KV cache needs one")
        blocks = x.float().reshape(-1, NVFP4_KV_BLOCK)
        codes, scales = nvfp4.quantize_blocks(blocks, s)
        return nvfp4.dequantize_blocks(codes, scales, s).reshape(x.shape).to(x.dtype)
    raise ValueError(f"unknown KV-cache format {kind!r}")
