"""The calibration directory's KV-cache statistics file: per attention layer amax(|k|) and amax(|v|)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from resserve_export.core.errors import UserError

FILE = "kv_cache.safetensors"


def save(stats: dict[str, dict[str, torch.Tensor]], path) -> None:

    tensors = {}
    for name in stats:
        tensors[f"{name}.k_amax"] = stats[name]["k_amax"].contiguous()
        tensors[f"{name}.v_amax"] = stats[name]["v_amax"].contiguous()
    save_file(dict(sorted(tensors.items())), str(path), metadata={"resserve_kv_cache": "1"})


def load(calib_dir, attention: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{attention module: (k_amax, v_amax)}`` from a calibration directory, for every module in
    `attention`; a one-line error when the calibration has none or lacks one, or an amax is not
    finite and positive."""


    path = Path(calib_dir) / FILE
    if not path.is_file():
        raise UserError(
            f"calibration in {calib_dir} has no KV-cache statistics ({FILE}): re-run `resserve-export calibrate` "
            "with this version, or pack with --kv-cache none"
        )
    try:
        t = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise UserError(f"{path} is not a readable safetensors file ({e}): re-run calibrate") from None
    out = {}
    for a in attention:
        k, v = t.get(f"{a}.k_amax"), t.get(f"{a}.v_amax")
        if k is None or v is None:
            raise UserError(f"calibration in {calib_dir} has no KV-cache statistics for {a}: re-run calibrate on this model")
        k, v = k.float().reshape(()), v.float().reshape(())
        for x in (k, v):
            if not bool(torch.isfinite(x)) or float(x) <= 0:
                raise UserError(f"calibration in {calib_dir} has KV amax {float(x)} for {a}: a KV scale must be finite and positive; re-run calibrate")
        out[a] = (k, v)
    return out
