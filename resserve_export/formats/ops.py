"""Quantize / dequantize entry points for both formats, with a fast CPU backend.

The eager functions in `nvfp4` and `mxfp4` are the reference. On CPU, large tensors go through
the same functions fused by `torch.compile`, applied to fixed-size chunks of blocks so that one
compiled graph serves every tensor shape. Both backends are bit-identical (tests call each one
directly); ``RESSERVE_BACKEND=reference`` forces the eager path.
"""

from __future__ import annotations

import functools
import os

import torch

from resserve_export.formats import registry
from resserve_export.core.compiling import compile_or_eager
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.formats.registry import Format
from resserve_export.formats.scale_rules import BlockScaleRule

# Blocks per compiled chunk: large enough to amortise dispatch, small enough to stay in cache.
_CHUNK_BLOCKS = 1 << 14
# Below this many elements the eager path is faster than a compiled call.
_FAST_MIN_NUMEL = 1 << 18
BACKENDS = ("auto", "reference", "compiled")


def check_format(fmt: str | Format) -> str:
    """The name of format `fmt`; ValueError lists the choices."""
    return registry.get(fmt).name


@functools.lru_cache(maxsize=None)
def _compiled(f: Format, rounding: ScaleRounding, rule: BlockScaleRule = BlockScaleRule.MINMAX):
    return compile_or_eager(f.blocks_fn(rounding, rule), dynamic=False, fullgraph=True)


def _pick_backend(x: torch.Tensor, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}, available: {list(BACKENDS)}")
    if backend != "auto":
        return backend
    if os.environ.get("RESSERVE_BACKEND", "") == "reference":
        return "reference"
    if x.device.type == "cpu" and x.numel() >= _FAST_MIN_NUMEL:
        return "compiled"
    return "reference"


def _run_chunked(fn, blocks: torch.Tensor, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply `fn` to fixed-size chunks of a ``[n, block]`` tensor (the tail chunk zero-padded)."""
    n, b = blocks.shape
    codes = torch.empty((n, b // 2), dtype=torch.uint8)
    scales = None
    for start in range(0, n, _CHUNK_BLOCKS):
        chunk = blocks[start : start + _CHUNK_BLOCKS]
        rows = chunk.shape[0]
        if rows < _CHUNK_BLOCKS:
            chunk = torch.cat([chunk, chunk.new_zeros((_CHUNK_BLOCKS - rows, b))])
        c, s = fn(chunk, *args)
        if scales is None:
            scales = torch.empty((n,), dtype=s.dtype)
        codes[start : start + rows] = c[:rows]
        scales[start : start + rows] = s[:rows]
    return codes, scales


def quantize(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    alpha: torch.Tensor | None = None,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    backend: str = "auto",
    scale_rule: BlockScaleRule | str = BlockScaleRule.MINMAX,
) -> FP4Tensor:
    """Quantize `x` ``[..., K]`` along its last dim (K a multiple of the block size).

    NVFP4: `alpha` is the FP32 tensor scale; None derives it from ``amax(x)`` (weights). MXFP4 has no
    tensor scale and uses `rounding` for its block exponents. `scale_rule` chooses NVFP4 block
    scales (`scale_rules`: ``minmax``, ModelOpt's, or the per-block error search ``mse``, meant
    for weights); MXFP4 takes ``minmax`` only.
    """
    f = registry.get(fmt)
    rounding = ScaleRounding(rounding)
    scale_rule = f.check_scale_rule(scale_rule)
    b = f.block
    K = x.shape[-1]
    if K % b:
        raise ValueError(f"last dim {K} is not a multiple of the {f.name} block size {b}")
    lead = x.shape[:-1]
    if f.has_tensor_scale:
        if alpha is None:
            alpha = f.tensor_alpha(x)
        alpha = torch.as_tensor(alpha, dtype=torch.float32, device=x.device).reshape(())
        args: tuple = (alpha,)
    else:
        alpha = None
        args = ()
    blocks = x.reshape(-1, b)
    if _pick_backend(x, backend) == "compiled" and blocks.shape[0] > 0:
        codes, scales = _run_chunked(_compiled(f, rounding, scale_rule), blocks.contiguous(), args)
    else:
        codes, scales = f.blocks_fn(rounding, scale_rule)(blocks, *args)
    return FP4Tensor(f.name, codes.reshape(*lead, K // 2), scales.reshape(*lead, K // b), alpha)


def dequantize(q: FP4Tensor) -> torch.Tensor:
    """FP32 values of `q`, same shape as the original tensor."""
    return q.dequantize()


def qdq(x: torch.Tensor, fmt: str | Format, **kw) -> torch.Tensor:
    """Quantize then dequantize (FP32 result)."""
    return dequantize(quantize(x, fmt, **kw))
