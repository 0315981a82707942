"""The checkpoint directory (docs/formats.md): its file names, ``quantization_config.resserve``
and the reader.

Layout of a checkpoint ``CKPT/``::

    config.json                      original config + quantization_config (incl. "resserve")
    hf_quant_config.json             NVFP4 only (ModelOpt unified HF format)
    model-0000i-of-0000n.safetensors plain W4A4 part; listed in model.safetensors.index.json
    resserve-0000i-of-0000n.safetensors  masks + K-Ext extensions; listed in
                                     resserve.safetensors.index.json, never in the model index
    tokenizer / generation config / other non-weight files of the source model

Tensors of a quantized linear ``<m>``:

    NVFP4 (ModelOpt): <m>.weight U8 [N,K/2], <m>.weight_scale F8_E4M3 [N,K/16],
                      <m>.weight_scale_2 F32 [], <m>.input_scale F32 []
    MXFP4 (compressed-tensors mxfp4-pack-quantized): <m>.weight_packed U8 [N,K/2],
                      <m>.weight_scale U8 (E8M0) [N,K/32]
    sidecar:          <m>.resserve_mask U8 [K/8] (ratio > 0),
                      <m>.resserve_weight U8 [N,K_E/2] + <m>.resserve_weight_scale (partial ratio)

The safetensors files themselves (dtypes, headers, shards, the streaming writer and the file
reader) are `storage.safetensors`. `read_checkpoint` is the reader `verify` and the vLLM plugin
use.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from resserve_export.core.errors import UserError
from resserve_export.core.names import EXT_SCALE_SUFFIX, EXT_WEIGHT_SUFFIX, MASK_SUFFIX, natural_key
from resserve_export.formats import kv as kv_format
from resserve_export.formats import registry
from resserve_export.formats.constants import SELECTION_GROUP
from resserve_export.formats.qtensor import FP4Tensor, read_base
from resserve_export.storage import fused_experts, hub_experts
from resserve_export.storage.safetensors import SafetensorsFiles

FORMAT_VERSION = 1
MODEL_PREFIX = "model"
SIDECAR_PREFIX = "resserve"
MODEL_INDEX = "model.safetensors.index.json"
SIDECAR_INDEX = "resserve.safetensors.index.json"


def dump_json(obj) -> str:
    """Deterministic JSON text (sorted keys, 2-space indent, trailing newline)."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------------------------
# quantization_config (the stock part and extra files come from the format: `registry.Format`)
# --------------------------------------------------------------------------------------------


def resserve_section(
    fmt: str, rounding: str, groups: list[dict], provenance: dict, kv_cache: str = "none", experts_layout: str = "per-expert"
) -> dict:
    """``quantization_config.resserve`` (docs/formats.md). `groups`: dicts with members, ratio, mode, K, K_E;
    `kv_cache` is recorded (with the attention modules' scale names) when it is not ``none``,
    `experts_layout` when it is not ``per-expert`` (``hub``: `storage.hub_experts`)."""
    f = registry.get(fmt)
    section = {
        "format_version": FORMAT_VERSION,
        "element_format": f.name,
        "selection_group": SELECTION_GROUP,
        "block_size": f.block,
        "mx_scale_rounding": f.rounding_record(rounding),
        "sidecar_index": SIDECAR_INDEX,
        "groups": groups,
        "provenance": provenance,
    }
    if kv_cache != "none":
        section["kv_cache"] = kv_cache
    if experts_layout != "per-expert":
        section["experts_layout"] = experts_layout
    return section


# --------------------------------------------------------------------------------------------
# Reading a checkpoint back
# --------------------------------------------------------------------------------------------


@dataclass
class PackedLinear:
    """One quantized linear as stored.

    base:        FP4Tensor of the weight (NVFP4: global_scale = weight_scale_2)
    ext:         FP4Tensor of the stored K-Ext extension ``[W_S | 0]`` (partial ratios), else None;
                 shares the base α
    mask:        uint8 ``[K/8]`` (ratio > 0), else None
    ratio, mode: the group's prefill ratio and ``plain`` | ``k_ext`` | ``full``
    input_scale: NVFP4 static activation α_x (fp32 scalar); None for MXFP4
    members:     the fused group this linear belongs to
    """

    module: str
    fmt: str
    base: FP4Tensor
    ext: FP4Tensor | None
    mask: torch.Tensor | None
    ratio: float
    mode: str
    input_scale: torch.Tensor | None
    members: tuple[str, ...] = field(default_factory=tuple)
    K: int = 0
    K_E: int = 0


class Checkpoint:
    """A packed checkpoint opened for reading (headers only until a module is read)."""

    def __init__(self, ckpt_dir: str | os.PathLike):
        self.dir = Path(ckpt_dir)
        cfg_path = self.dir / "config.json"
        if not cfg_path.exists():
            raise UserError(f"{self.dir} is not a checkpoint directory (no config.json): pass the --out of `pack`")
        self.config = json.loads(cfg_path.read_text())
        qc = self.config.get("quantization_config") or {}
        self.resserve = qc.get("resserve")
        if not self.resserve:
            raise UserError(f"{self.dir} was not written by resserve-export pack (no quantization_config.resserve)")
        if self.resserve.get("format_version") != FORMAT_VERSION:
            raise UserError(
                f"{self.dir} has resserve format version {self.resserve.get('format_version')}, "
                f"this tool reads {FORMAT_VERSION}: re-pack it with this version"
            )
        self.fmt: str = self.resserve["element_format"]
        try:
            self.format = registry.get(self.fmt)
        except ValueError:
            raise UserError(
                f"{self.dir} has element format {self.fmt!r}; this tool reads {', '.join(registry.FORMATS)}: re-pack it with this version"
            ) from None
        self.rounding: str = self.resserve.get("mx_scale_rounding") or "ceil"
        self.groups: list[dict] = self.resserve["groups"]
        self.kv_cache: str = self.resserve.get("kv_cache", "none")
        self.experts_layout: str = self.resserve.get("experts_layout", "per-expert")
        self._group_of = {m: g for g in self.groups for m in g["members"]}
        self.model = SafetensorsFiles(self._indexed(MODEL_INDEX))
        if self.experts_layout == hub_experts.HUB:  # gpt-oss's experts as the hub's MXFP4 blocks
            parts = hub_experts.read_parts(self.model.shapes())
        else:  # experts written fused per expert (gpt-oss)
            parts = fused_experts.read_parts(self.model.shapes())
        if parts:
            self.model.add_parts(parts)
        side = self.dir / SIDECAR_INDEX
        self.sidecar = SafetensorsFiles(self._indexed(SIDECAR_INDEX)) if side.exists() else SafetensorsFiles([])

    def _indexed(self, index: str) -> list[Path]:
        path = self.dir / index
        if not path.exists():
            raise UserError(f"{self.dir} has no {index}: the checkpoint is incomplete, re-run pack")
        names = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        missing = [n for n in names if not (self.dir / n).exists()]
        if missing:
            raise UserError(f"{self.dir} lacks {missing[0]} listed in {index}: the checkpoint is incomplete, re-run pack")
        return [self.dir / n for n in names]

    @property
    def modules(self) -> list[str]:
        return [m for g in self.groups for m in g["members"]]

    def kv_scales(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{attention module: (k_scale, v_scale)}`` (0-d float32) of a checkpoint with KV-cache
        scales, else empty."""
        if self.kv_cache == "none":
            return {}
        out = {}
        suffix_k = kv_format.scale_names("", self.format.kv_style)[0]
        for name in self.model.entries:
            if name.endswith(suffix_k):
                attn = name[: -len(suffix_k)]
                k, v = kv_format.scale_names(attn, self.format.kv_style)
                if v not in self.model:
                    raise UserError(f"{self.dir} has {k} but no {v}: the checkpoint is incomplete, re-run pack")
                out[attn] = (self.model.get(k).float().reshape(()), self.model.get(v).float().reshape(()))
        if not out:
            raise UserError(f"{self.dir} declares a {self.kv_cache} KV cache but holds no KV-cache scales: re-run pack")
        return {a: out[a] for a in sorted(out, key=natural_key)}

    def read(self, module: str) -> PackedLinear:
        g = self._group_of.get(module)
        if g is None:
            raise KeyError(f"{module} is not a quantized linear of this checkpoint")
        fmt = self.fmt
        base, input_scale = read_base(self.format, self.model.get, module)
        alpha = base.global_scale
        mask = self.sidecar.get(f"{module}.{MASK_SUFFIX}") if f"{module}.{MASK_SUFFIX}" in self.sidecar else None
        ext = None
        if f"{module}.{EXT_WEIGHT_SUFFIX}" in self.sidecar:
            ext = FP4Tensor(
                fmt, self.sidecar.get(f"{module}.{EXT_WEIGHT_SUFFIX}"), self.sidecar.get(f"{module}.{EXT_SCALE_SUFFIX}"), alpha
            )
        return PackedLinear(
            module, fmt, base, ext, mask, float(g["ratio"]), g["mode"], input_scale, tuple(g["members"]), g["K"], g["K_E"]
        )


def read_checkpoint(ckpt_dir: str | os.PathLike, modules: list[str] | None = None) -> dict[str, PackedLinear]:
    """``{module: PackedLinear}`` for every quantized linear (or the given ones) of a checkpoint.

    Each entry's ``base.dequantize()`` is the plain FP4 weight; ``FP4Tensor.cat([base, ext])`` is
    the quantized extended weight ``[W | W_S | 0]`` (docs/formats.md, "The extended weight"). For large models open a
    `Checkpoint` and call ``read(module)`` one module at a time.
    """
    ck = Checkpoint(ckpt_dir)
    return {m: ck.read(m) for m in (modules if modules is not None else ck.modules)}


__all__ = [
    "Checkpoint",
    "PackedLinear",
    "read_checkpoint",
    "FORMAT_VERSION",
    "MODEL_PREFIX",
    "SIDECAR_PREFIX",
    "MODEL_INDEX",
    "SIDECAR_INDEX",
    "dump_json",
    "resserve_section",
]
