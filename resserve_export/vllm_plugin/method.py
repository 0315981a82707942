"""The ``resserve`` quantization method: serve residue compensation in vLLM by emulation.

The checkpoint's plain part loads through vLLM's own loader for its format (ModelOpt NVFP4 or
compressed-tensors MXFP4: same parameters, same weight loaders, fused q/k/v and gate/up shards);
after loading, each quantized linear reads its sidecar entries (mask, K-Ext extension, SPEC §7),
dequantizes base and extension to FP32 once, and computes every call with
:func:`resserve_export.emulate.quantized_matmul`, the reference that `verify` and the planner use:

  rows > decode_rows    the layer's own mode: K-Ext with the selected residues (partial ρ),
                        full compensation (ρ = 1) or plain (ρ = 0)           — prefill
  rows <= decode_rows   full residue compensation for every compensated layer — decode

``decode_rows`` is ``RESSERVE_DECODE_ROWS`` (default 16). The output is cast to the model dtype;
in a float32 engine the whole linear is FP32 (the method accepts float32, bfloat16 and float16).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import get_quantization_config, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from .. import registry
from ..emulate import quantized_matmul
from ..formats import dequantize
from ..mxfp4 import ScaleRounding
from ..qtensor import FP4Tensor
from ..selection import mode_of
from ._register import method_enabled

NAME = "resserve"
DECODE_ROWS_ENV = "RESSERVE_DECODE_ROWS"
DEFAULT_DECODE_ROWS = 16
SIDECAR_INDEX = "resserve.safetensors.index.json"


def decode_rows() -> int:
    raw = os.environ.get(DECODE_ROWS_ENV, str(DEFAULT_DECODE_ROWS))
    try:
        rows = int(raw)
    except ValueError:
        raise ValueError(f"{DECODE_ROWS_ENV}={raw!r} is not an integer: set a row count such as 16") from None
    if rows < 0:
        raise ValueError(f"{DECODE_ROWS_ENV}={rows} is negative: set a row count such as 16")
    return rows


def _model_dir() -> Path:
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    model = getattr(getattr(cfg, "model_config", None), "model", None)
    if model is None:
        raise RuntimeError("resserve: no model in vLLM's current config, cannot find the sidecar")
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["resserve*", "*.json"]))


class Sidecar:
    """The ``resserve-*.safetensors`` shards of a checkpoint, read through their own index."""

    def __init__(self, ckpt: Path):
        index = ckpt / SIDECAR_INDEX
        self.files: dict[str, Path] = {}
        if index.exists():
            wm = json.loads(index.read_text())["weight_map"]
            self.files = {k: ckpt / v for k, v in wm.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"resserve: the sidecar has no tensor {name}; the checkpoint is incomplete, re-run pack")
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)


@dataclass
class LoadedWeight:
    """What :func:`quantized_matmul` reads from a weight, built from checkpoint tensors."""

    fmt: str
    ratio: float
    rounding: ScaleRounding
    mask: torch.Tensor | None
    w: torch.Tensor
    w_ext: torch.Tensor | None


@register_quantization_config(NAME)
class ResServeConfig(QuantizationConfig):
    """Wraps the stock config of the checkpoint's format and replaces its linear method."""

    def __init__(self, hf_quant_cfg: dict[str, Any]):
        super().__init__()
        if not isinstance(hf_quant_cfg.get("resserve"), dict):
            raise ValueError(
                "resserve: this checkpoint's quantization_config has no resserve section; "
                "write it with `resserve-export pack`, or serve it without --quantization resserve"
            )
        self.section = hf_quant_cfg["resserve"]
        self.fmt = self.section["element_format"]
        try:
            self.format = registry.get(self.fmt)
        except ValueError:
            raise ValueError(f"resserve: unknown element format {self.fmt!r}, expected one of {list(registry.FORMATS)}") from None
        inner_cfg = {k: v for k, v in hf_quant_cfg.items() if k != "resserve"}
        # The stock method that loads the format's plain part.
        self.inner = get_quantization_config(self.format.stock_method).from_config(inner_cfg)
        self.rounding = ScaleRounding(self.section.get("mx_scale_rounding") or "ceil")
        self.groups: dict[str, dict] = {m: g for g in self.section["groups"] for m in g["members"]}
        self._sidecar: Sidecar | None = None

    # -- QuantizationConfig interface ------------------------------------------------------
    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ResServeConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        # Take over a checkpoint with a resserve section unless the user named another method.
        if not method_enabled() or not isinstance(hf_quant_cfg, dict) or "resserve" not in hf_quant_cfg:
            return None
        if user_quant not in (None, NAME):
            return None
        return NAME

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        self.inner.apply_vllm_mapper(hf_to_vllm_mapper)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        self.inner.packed_modules_mapping = self.packed_modules_mapping
        method = self.inner.get_quant_method(layer, prefix)
        if not isinstance(layer, LinearBase) or method is None or isinstance(method, UnquantizedLinearMethod):
            return method
        members = self.members(prefix)
        missing = [m for m in members if m not in self.groups]
        if missing:
            raise ValueError(f"resserve: {missing[0]} is quantized but has no entry in quantization_config.resserve.groups")
        return ResServeLinearMethod(self, method, members)

    # -- helpers ---------------------------------------------------------------------------
    def members(self, prefix: str) -> list[str]:
        """Checkpoint module names of a (possibly fused) vLLM linear, in shard order."""
        parent, _, leaf = prefix.rpartition(".")
        fused = self.packed_modules_mapping.get(leaf)
        if not fused:
            return [prefix]
        return [f"{parent}.{m}" if parent else m for m in fused]

    @property
    def sidecar(self) -> Sidecar:
        if self._sidecar is None:
            self._sidecar = Sidecar(_model_dir())
        return self._sidecar


# The stock methods we wrap create vLLM-parameter objects that need the v2 (fused-shard) loader.
@register_weight_loader_v2_supported_method
class ResServeLinearMethod(LinearMethodBase):
    """Stock parameters and loaders; compensated emulated matmul at run time."""

    def __init__(self, config: ResServeConfig, inner: LinearMethodBase, members: list[str]):
        self.config = config
        self.inner = inner
        self.members = members
        ratios = {float(config.groups[m]["ratio"]) for m in members}
        if len(ratios) != 1:
            raise ValueError(f"resserve: fused members {members} carry different ratios {sorted(ratios)}")
        self.ratio = ratios.pop()
        self.mode = mode_of(self.ratio)
        self.decode_rows = decode_rows()

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype, **extra):
        self.inner.create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype, **extra
        )

    def _base(self, layer) -> tuple[FP4Tensor, torch.Tensor | None]:
        """The stored weight and input α from the layer's stock parameters (named as in the
        checkpoint); a fused layer holds one tensor scale per shard, and serves with their max."""

        def param(name: str) -> torch.Tensor:  # "layer.<checkpoint suffix>": the stock parameter of that name
            return getattr(layer, name.removeprefix("layer.")).detach()

        return self.config.format.read_base(param, "layer", scalar=lambda t: t.float().max().reshape(()))

    def process_weights_after_loading(self, layer) -> None:
        base, input_alpha = self._base(layer)
        side = self.config.sidecar
        mask = None
        w_ext = None
        if self.ratio > 0:
            masks = [side.get(f"{m}.resserve_mask") for m in self.members]
            if any(not torch.equal(masks[0], x) for x in masks[1:]):
                raise ValueError(f"resserve: fused members {self.members} carry different masks")
            mask = masks[0]
        if self.mode == "k_ext":
            f = self.config.format
            codes = torch.cat([side.get(f"{m}.resserve_weight") for m in self.members])
            scales = f.as_scales(torch.cat([side.get(f"{m}.resserve_weight_scale") for m in self.members]))
            w_ext = dequantize(FP4Tensor(f.name, codes, scales, base.global_scale))
        layer.resserve = LoadedWeight(self.config.fmt, self.ratio, self.config.rounding, mask, dequantize(base), w_ext)
        layer.resserve_input_alpha = input_alpha

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        qw: LoadedWeight = layer.resserve
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        mode = self.mode
        if mode != "plain" and x2.shape[0] <= self.decode_rows:
            mode = "full"
        y = quantized_matmul(x2.float(), qw, input_alpha=layer.resserve_input_alpha, mode=mode)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])
