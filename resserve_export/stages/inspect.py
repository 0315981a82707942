"""`inspect`: what a packed checkpoint holds, from its config and safetensors headers only."""

from __future__ import annotations

import math
import os
from pathlib import Path

from resserve_export.formats import kv as kv_format
from resserve_export.storage.checkpoint import Checkpoint
from resserve_export.storage.safetensors import ST_DTYPES


def inspect_checkpoint(ckpt_dir: str | os.PathLike) -> dict:
    """Format, per-group ratio / mode / bytes, and totals (no tensor data is read).

    Per group: ``base`` = bytes of the members' plain tensors, ``extension`` = sidecar bytes
    (masks + K-Ext weights). ``extension_share`` = sidecar bytes / all safetensors data bytes.
    """
    ck = Checkpoint(ckpt_dir)
    model, side = ck.model.entries, ck.sidecar.entries
    kv = ck.kv_scales()
    kv_names = {n for a in kv for n in kv_format.scale_names(a, ck.format.kv_style)}

    def size(e) -> int:
        """Bytes a tensor presents (an expert's gate or up, cut from its fused w13, owns its half)."""
        return math.prod(e.shape) * ST_DTYPES[e.dtype][1]

    def owned(entries, module):
        prefix = module + "."
        return sum(size(e) for n, e in entries.items() if n.startswith(prefix) and "." not in n[len(prefix):] and n not in kv_names)

    rows = []
    for g in ck.groups:
        base = sum(owned(model, m) for m in g["members"])
        ext = sum(owned(side, m) for m in g["members"])
        rows.append({**g, "base_bytes": base, "extension_bytes": ext})
    quantized = sum(r["base_bytes"] for r in rows)
    kv_bytes = sum(model[n].nbytes for n in kv_names)
    model_bytes = sum(size(e) for e in model.values())
    side_bytes = sum(e.nbytes for e in side.values())
    files = sum(p.stat().st_size for p in Path(ck.dir).iterdir() if p.is_file())
    modes: dict[str, int] = {}
    for r in rows:
        modes[r["mode"]] = modes.get(r["mode"], 0) + 1
    qc = ck.config["quantization_config"]
    return {
        "path": str(ck.dir),
        "format": ck.fmt,
        "quant_method": qc.get("quant_method"),
        "mx_scale_rounding": ck.resserve.get("mx_scale_rounding"),
        "groups": rows,
        "modes": modes,
        "bytes": {
            "quantized_linears": quantized,
            "unquantized": model_bytes - quantized - kv_bytes,
            "kv_cache_scales": kv_bytes,
            "sidecar": side_bytes,
            "all_files": files,
        },
        "extension_share": side_bytes / (model_bytes + side_bytes) if model_bytes + side_bytes else 0.0,
        "kv_cache": {
            "format": ck.kv_cache,
            "layers": [{"module": a, "k_scale": float(k), "v_scale": float(v)} for a, (k, v) in kv.items()],
        },
        "weight_algo": ((ck.resserve.get("provenance") or {}).get("weight_algo") or {"name": "rtn"}),
        "provenance": ck.resserve.get("provenance"),
    }


__all__ = ["inspect_checkpoint"]
