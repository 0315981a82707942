"""E2M1 (FP4) element encoding and nibble packing (docs/formats.md, "The FP4 element").

Rounding is to nearest with ties to the even code; magnitudes above 6 saturate to 6; the sign
bit is the input's sign, so a negative value that rounds to zero becomes -0 (code 8). Threshold
compares are used instead of a table search: they vectorise well and `torch.compile` fuses them.
"""

from __future__ import annotations

import torch

from resserve_export.formats.constants import F4_E2M1_VALUES, F4_SIGN_BIT

# Midpoints between neighbouring E2M1 magnitudes. At a midpoint the tie goes to the even code:
# 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (code 2), 1.75 -> 2 (code 4),
# 2.5 -> 2 (code 4), 3.5 -> 4 (code 6), 5 -> 4 (code 6).
# "Round down at the tie" midpoints use `>`, "round up at the tie" ones use `>=`.
_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIE_UP = (0.75, 1.75, 3.5)

_VALUES = torch.tensor(F4_E2M1_VALUES + tuple(-v for v in F4_E2M1_VALUES), dtype=torch.float32)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to E2M1 codes, uint8 in 0..15."""
    return _encode_i32(x).to(torch.uint8)


def _encode_i32(x: torch.Tensor) -> torch.Tensor:
    # int32 accumulation: inductor vectorises it, uint8 in-place adds it does not (18x slower).
    x = x.float()
    a = x.abs()
    i32 = torch.int32
    code = (a > 0.25).to(i32) + (a >= 0.75).to(i32) + (a > 1.25).to(i32) + (a >= 1.75).to(i32)
    code = code + (a > 2.5).to(i32) + (a >= 3.5).to(i32) + (a > 5.0).to(i32)
    return code + (x < 0).to(i32) * F4_SIGN_BIT


def encode_e2m1_packed(x: torch.Tensor) -> torch.Tensor:
    """`encode_e2m1` followed by `pack_fp4`, fused in int32 (the fast path's body)."""
    c = _encode_i32(x)
    return (c[..., 0::2] + (c[..., 1::2] << 4)).to(torch.uint8)


_TABLES: dict[torch.device, torch.Tensor] = {}


def e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 E2M1 values (FP32, indexed by code) on `device`, copied there once: a host-to-GPU
    copy at every decode would wait for the GPU to finish its queued work (a host sync)."""
    if device.type == "cpu":
        return _VALUES
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = _VALUES.to(device)
    return table


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) to float32 values."""
    if codes.device.type == "cpu" or torch.compiler.is_compiling():
        return _VALUES.to(codes.device)[codes.long()]
    return e2m1_table(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes along the last dim: element 2i in the low nibble, 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of FP4 codes ({codes.shape[-1]})")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_fp4`: uint8 [..., n] -> codes uint8 [..., 2n]."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


__all__ = ["encode_e2m1", "encode_e2m1_packed", "decode_e2m1", "e2m1_table", "pack_fp4", "unpack_fp4", "F4_SIGN_BIT"]
