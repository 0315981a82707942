"""The quantized-tensor container shared by both FP4 formats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from resserve_export.formats import registry


@dataclass(frozen=True)
class FP4Tensor:
    """Packed FP4 codes with their block scales.

    codes:        uint8 ``[..., K/2]`` (element 2i low nibble, 2i+1 high nibble)
    scales:       NVFP4: float8_e4m3fn ``[..., K/16]``; MXFP4: uint8 E8M0 ``[..., K/32]``
    global_scale: NVFP4: float32 scalar α; MXFP4: None
    """

    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None = None

    @property
    def format(self) -> registry.Format:
        """The `registry.Format` named by `fmt`."""
        return registry.get(self.fmt)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.codes.shape[:-1], self.codes.shape[-1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values of the tensor (FP32 arithmetic, then `dtype`), same shape as the original."""
        f = self.format
        lead = self.codes.shape[:-1]
        packed = self.codes.reshape(*lead, -1, f.block // 2)
        vals = f.dequantize_blocks(packed, self.scales, self.global_scale)
        return vals.reshape(*lead, -1).to(dtype)

    def narrow(self, start: int, length: int) -> "FP4Tensor":
        """Columns ``[start, start+length)`` along the last dim (block-aligned)."""
        b = self.format.block
        if start % b or length % b:
            raise ValueError(f"narrow({start}, {length}) is not aligned to {self.fmt} blocks of {b}")
        return FP4Tensor(
            self.fmt,
            self.codes[..., start // 2 : (start + length) // 2],
            self.scales[..., start // b : (start + length) // b],
            self.global_scale,
        )

    @staticmethod
    def cat(parts: list["FP4Tensor"]) -> "FP4Tensor":
        """Concatenate along the last dim; all parts share format and global scale."""
        first = parts[0]
        return FP4Tensor(
            first.fmt,
            torch.cat([p.codes for p in parts], dim=-1),
            torch.cat([p.scales for p in parts], dim=-1),
            first.global_scale,
        )


def read_base(f: registry.Format, get: Callable[[str], torch.Tensor], module: str, scalar: Callable | None = None):
    """(FP4Tensor of a stored weight in format `f`, input α or None) through ``get(tensor name)``.

    `scalar` turns a stored tensor scale into the FP32 0-d α (default: ``t.float().reshape(())``,
    a checkpoint's scalar; vLLM's fused layers hold one per shard and pass their max)."""
    if scalar is None:
        scalar = registry.stored_scalar
    weight = get(f"{module}.{f.weight_name}")
    scales = f.as_scales(get(f"{module}.{f.scale_name}"))
    if not f.has_tensor_scale:
        return FP4Tensor(f.name, weight, scales), None
    alpha = scalar(get(f"{module}.{f.tensor_scale_name}"))
    input_alpha = scalar(get(f"{module}.{f.input_scale_name}"))
    return FP4Tensor(f.name, weight, scales, alpha), input_alpha
