"""The ``resserve`` quantization method: serve residue compensation in vLLM by emulation.

The checkpoint's plain part loads through vLLM's own loader for its format (ModelOpt NVFP4 or
compressed-tensors MXFP4: same parameters, same weight loaders, fused q/k/v and gate/up shards);
after loading, each quantized linear reads its sidecar entries (mask, K-Ext extension, docs/formats.md
"Checkpoint directory"),
dequantizes base and extension to FP32 once, and computes every call with
:func:`resserve_export.emulate.quantized_matmul`, the reference that `verify` and the planner use:

  rows > decode_rows    the layer's own mode: K-Ext with the selected residues (partial ρ),
                        full compensation (ρ = 1) or plain (ρ = 0)           — prefill
  rows <= decode_rows   full residue compensation for every compensated layer — decode

``decode_rows`` is ``RESSERVE_DECODE_ROWS`` (default 16). The output is cast to the model dtype;
in a float32 engine the whole linear is FP32 (the method accepts float32, bfloat16 and float16).

Mixture-of-experts layers (:class:`ResServeMoEMethod`) load through the stock MoE method's
parameters (per expert: w13 = gate | up, sharing one tensor scale and one input scale, and w2 =
down). Each expert reads its own sidecar entries under the checkpoint's per-expert module names
and computes, over the rows routed to it, exactly what two compensated linears compute: W13 with
the expert's input α, vLLM's native SiLU-and-mul in the model dtype, W2 with its own α. The mode
follows the same rule, from the rows of the whole engine step (a decode step's experts use full
compensation however few rows each receives). The routing weight times each expert's output is
added into an FP32 sum per token, cast to the model dtype; where the model weights the expert's
input instead (Llama 4: ``apply_router_weight_on_input``), the input rows are scaled by it in the
model dtype and the outputs summed unweighted. Experts with biases and vLLM's ``swigluoai``
(gpt-oss): the method makes the ``w13_bias`` / ``w2_bias`` parameters the stock FP4 methods lack
(vLLM's gpt-oss loader fills them); each FP32 product gets its bias added before the cast, w13's
gate and up rows (and so its K-Ext extension rows) are interleaved, and the activation is vLLM's
native ``swigluoai``.

A model whose vLLM loader permutes a linear's stored rows (Llama 4's ``q_proj`` / ``k_proj``, for
its rotary layout) has the members' sidecar rows permuted the same way (`rotary_row_heads`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts, UnquantizedFusedMoEMethod
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import get_quantization_config, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from resserve_export.formats import registry
from resserve_export.algorithms.emulate import quantized_matmul
from resserve_export.modeling.experts import ROLES
from resserve_export.formats.ops import dequantize
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.qtensor import FP4Tensor, read_base
from resserve_export.algorithms.selection import mode_of
from resserve_export.vllm_plugin.settings import method_enabled
from resserve_export.vllm_plugin.moe import SUPPORTED_ACTIVATIONS, act_and_mul, routed_rows
from resserve_export.core.names import MASK_SUFFIX, EXT_WEIGHT_SUFFIX, EXT_SCALE_SUFFIX
from resserve_export.storage.checkpoint import SIDECAR_INDEX
from resserve_export.storage.hub_experts import HUB

NAME = "resserve"
DECODE_ROWS_ENV = "RESSERVE_DECODE_ROWS"
DEFAULT_DECODE_ROWS = 16


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
        # vLLM module name -> checkpoint module name, where the model renames (`apply_vllm_mapper`)
        self.checkpoint_names: dict[str, str] = {}
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
        # gpt-oss's experts in the hub's layout (pack --experts-layout hub) are vLLM's own
        # gpt_oss_mxfp4 method's, with no sidecar: left to it.
        if (hf_quant_cfg.get("resserve") or {}).get("experts_layout") == HUB:
            return None
        if user_quant not in (None, NAME):
            return None
        return NAME

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """The groups under the vLLM model's module names (vLLM maps some families' checkpoint
        names, e.g. Nemotron-H's ``backbone.`` to ``model.``), each member keeping its checkpoint
        name for its sidecar tensors."""
        self.inner.apply_vllm_mapper(hf_to_vllm_mapper)
        groups, names = {}, {}
        for m, g in self.groups.items():
            v = hf_to_vllm_mapper.map_name(m)
            if v is not None:
                groups[v], names[v] = g, self.checkpoint_names.get(m, m)
        # A mapper made for tensor names may rename a module's leaf (gpt-oss: ``.down_proj`` of its
        # fused experts to ``.w2_weight``), where vLLM's MoE layer still names its experts' members
        # ``E.down_proj``: those keep their checkpoint name too.
        for m, g in self.groups.items():
            if m not in groups:
                groups[m], names[m] = g, self.checkpoint_names.get(m, m)
        self.groups, self.checkpoint_names = groups, names

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        self.inner.packed_modules_mapping = self.packed_modules_mapping
        method = self.inner.get_quant_method(layer, prefix)
        if isinstance(layer, RoutedExperts):
            if method is None or isinstance(method, UnquantizedFusedMoEMethod):
                return method
            return moe_method(self, method, layer, prefix)
        if not isinstance(layer, LinearBase) or method is None or isinstance(method, UnquantizedLinearMethod):
            return method
        return ResServeLinearMethod(self, method, self.members(prefix))

    # -- helpers ---------------------------------------------------------------------------
    def members(self, prefix: str) -> list[str]:
        """Checkpoint module names of a (possibly fused) vLLM linear, in shard order."""
        parent, _, leaf = prefix.rpartition(".")
        fused = self.packed_modules_mapping.get(leaf)
        if not fused:
            return [prefix]
        return [f"{parent}.{m}" if parent else m for m in fused]

    def check_members(self, members: list[str]) -> None:
        missing = [m for m in members if m not in self.groups]
        if missing:
            raise ValueError(f"resserve: {missing[0]} is quantized but has no entry in quantization_config.resserve.groups")

    def ratio(self, members: list[str]) -> float:
        """The one ratio of a fused group's members."""
        ratios = {float(self.groups[m]["ratio"]) for m in members}
        if len(ratios) != 1:
            raise ValueError(f"resserve: fused members {members} carry different ratios {sorted(ratios)}")
        return ratios.pop()

    def load_weight(self, members: list[str], ratio: float, base: FP4Tensor, row_heads: list[int | None] | None = None,
                    interleaved: bool = False) -> LoadedWeight:
        """A (fused) linear's weight for :func:`quantized_matmul`: the stored base `base` (the
        members' rows in order, as vLLM loaded them) with the members' sidecar mask and K-Ext
        extension. `row_heads`: per member, the head count of the rotary row permutation vLLM's
        model applied to that member's stored rows at load (`rotary_row_heads`), applied to its
        extension rows too."""
        side = self.sidecar
        members = [self.checkpoint_names.get(m, m) for m in members]  # the sidecar's names
        mask = None
        w_ext = None
        if ratio > 0:
            masks = [side.get(f"{m}.{MASK_SUFFIX}") for m in members]
            if any(not torch.equal(masks[0], x) for x in masks[1:]):
                raise ValueError(f"resserve: fused members {members} carry different masks")
            mask = masks[0]
        if mode_of(ratio) == "k_ext":
            f = self.format
            heads = row_heads or [None] * len(members)
            join = interleave_rows if interleaved else torch.cat
            codes = join([permute_rows(side.get(f"{m}.{EXT_WEIGHT_SUFFIX}"), h) for m, h in zip(members, heads)])
            scales = f.as_scales(join([permute_rows(side.get(f"{m}.{EXT_SCALE_SUFFIX}"), h) for m, h in zip(members, heads)]))
            w_ext = dequantize(FP4Tensor(f.name, codes, scales, base.global_scale))
        return LoadedWeight(self.fmt, ratio, self.rounding, mask, dequantize(base), w_ext)

    @property
    def sidecar(self) -> Sidecar:
        if self._sidecar is None:
            self._sidecar = Sidecar(_model_dir())
        return self._sidecar


def rotary_row_heads(member: str) -> int | None:
    """The head count by which vLLM's model of the checkpoint being built permutes the rows of
    linear `member` at load, else None. vLLM's Llama 4 model turns the checkpoint's interleaved
    rotary pairs of ``q_proj`` / ``k_proj`` into halves (``permute_qk_weight_for_rotary``: per head,
    rows ``(pair, 2)`` transposed to ``(2, pair)``); the sidecar's rows of those members must move
    with them."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    mc = getattr(cfg, "model_config", None)
    text = getattr(mc, "hf_text_config", None)
    if getattr(text, "model_type", None) not in ("llama4_text", "llama4"):
        return None
    leaf = member.rsplit(".", 1)[-1]
    if leaf == "q_proj":
        return int(text.num_attention_heads)
    if leaf == "k_proj":
        return int(text.num_key_value_heads)
    return None


def interleave_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The members' rows interleaved (row i of each in turn), as gpt-oss's w13 holds gate and up."""
    return torch.stack(parts, 1).reshape(-1, *parts[0].shape[1:])


def permute_rows(t: torch.Tensor, heads: int | None) -> torch.Tensor:
    """`t`'s rows as vLLM's Llama 4 loader permutes a q / k projection's rows (`rotary_row_heads`)."""
    if heads is None:
        return t
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(t.shape)


# The stock methods we wrap create vLLM-parameter objects that need the v2 (fused-shard) loader.
@register_weight_loader_v2_supported_method
class ResServeLinearMethod(LinearMethodBase):
    """Stock parameters and loaders; compensated emulated matmul at run time."""

    def __init__(self, config: ResServeConfig, inner: LinearMethodBase, members: list[str]):
        self.config = config
        self.inner = inner
        self.members = members
        config.check_members(members)
        self.ratio = config.ratio(members)
        self.mode = mode_of(self.ratio)
        self.decode_rows = decode_rows()
        self.row_heads = [rotary_row_heads(m) for m in members]  # read now: vLLM's config context is that of this model

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype, **extra):
        self.inner.create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype, **extra
        )

    def _base(self, layer) -> tuple[FP4Tensor, torch.Tensor | None]:
        """The stored weight and input α from the layer's stock parameters (named as in the
        checkpoint); a fused layer holds one tensor scale per shard, and serves with their max."""

        def param(name: str) -> torch.Tensor:  # "layer.<checkpoint suffix>": the stock parameter of that name
            return getattr(layer, name.removeprefix("layer.")).detach()

        return read_base(self.config.format, param, "layer", scalar=lambda t: t.float().max().reshape(()))

    def process_weights_after_loading(self, layer) -> None:
        base, input_alpha = self._base(layer)
        layer.resserve = self.config.load_weight(self.members, self.ratio, base, self.row_heads)
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


@dataclass
class ExpertProjection:
    """One expert's w13 (gate | up) or w2 (down) as :func:`quantized_matmul` reads it."""

    weight: LoadedWeight
    input_alpha: torch.Tensor | None
    mode: str
    bias: torch.Tensor | None = None  # FP32, added to the FP32 product


class ResServeMoEMethod(FusedMoEMethodBase):
    """Stock MoE parameters and loaders; per expert, compensated emulated products at run time
    (see the module docstring)."""

    def __init__(self, config: ResServeConfig, inner: FusedMoEMethodBase, layer, prefix: str):
        super().__init__(inner.moe)
        self.config = config
        self.inner = inner
        self.prefix = prefix
        self.decode_rows = decode_rows()
        if layer.activation not in (*SUPPORTED_ACTIVATIONS, MoEActivation.SWIGLUOAI):
            raise ValueError(f"resserve: {prefix}: the {layer.activation.value} activation of the experts is not served by the resserve method")
        # gpt-oss: w13's gate and up rows interleaved (swigluoai), biases on both products
        self.interleaved = layer.activation == MoEActivation.SWIGLUOAI
        self.has_bias = bool(inner.moe.has_bias)
        leaves = (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)
        if leaves[1] is None:
            raise ValueError(f"resserve: {prefix}: only gated experts are supported")
        # Llama 4: the routing weight scales the expert's input, and outputs are summed unweighted
        self.weights_on_input = bool(layer.apply_router_weight_on_input)
        if tuple(ROLES.get(leaf) for leaf in leaves) != ("gate", "up", "down"):
            raise ValueError(f"resserve: {prefix}: expert projections {leaves} are not the gate / up / down that pack names")
        self.leaves = leaves
        self.num_experts = layer.global_num_experts
        for e in range(self.num_experts):
            for members in self.members(e):
                config.check_members(members)
        self.experts: list[tuple[ExpertProjection, ExpertProjection]] = []

    def members(self, e: int) -> tuple[list[str], list[str]]:
        """Checkpoint module names of expert `e`'s (w13, w2): ([gate, up], [down])."""
        gate, up, down = (f"{self.prefix}.{e}.{leaf}" for leaf in self.leaves)
        return [gate, up], [down]

    # -- loading: the stock method's parameters -------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        self.inner.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra)
        if self.has_bias and not hasattr(layer, "w13_bias"):  # the stock FP4 methods make none (gpt-oss's loader copies into them)
            for name, shape in (("w13_bias", (num_experts, 2 * intermediate_size_per_partition)), ("w2_bias", (num_experts, hidden_size))):
                param = torch.nn.Parameter(torch.zeros(shape, dtype=params_dtype), requires_grad=False)
                layer.register_parameter(name, param)
                set_weight_attrs(param, {"weight_loader": extra["weight_loader"]})

    def uses_weight_scale_2_pattern(self) -> bool:
        return self.inner.uses_weight_scale_2_pattern()

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer) -> None:
        if layer.local_num_experts != layer.global_num_experts:
            raise ValueError(f"resserve: {self.prefix}: expert parallelism is not supported; serve without --enable-expert-parallel")
        f = self.config.format
        scalar = lambda t: t.float().max().reshape(())  # gate and up hold one each, equal
        self.experts = []
        for e in range(self.num_experts):
            def param(name: str, e=e) -> torch.Tensor:  # "w13.<checkpoint suffix>": expert e of w13_<suffix>
                proj, _, suffix = name.partition(".")
                return getattr(layer, f"{proj}_{suffix}")[e].detach()

            pair = []
            for proj, members in zip(("w13", "w2"), self.members(e)):
                base, alpha = read_base(f, param, proj, scalar=scalar)
                ratio = self.config.ratio(members)
                inter = self.interleaved and proj == "w13"
                bias = getattr(layer, f"{proj}_bias")[e].detach().float() if self.has_bias else None
                pair.append(ExpertProjection(self.config.load_weight(members, ratio, base, interleaved=inter), alpha, mode_of(ratio), bias))
            self.experts.append(tuple(pair))

    # -- run time ----------------------------------------------------------------------------------
    def _product(self, proj: ExpertProjection, x: torch.Tensor, step_rows: int) -> torch.Tensor:
        mode = proj.mode
        if mode != "plain" and step_rows <= self.decode_rows:
            mode = "full"
        y = quantized_matmul(x.float(), proj.weight, input_alpha=proj.input_alpha, mode=mode)
        return y if proj.bias is None else y + proj.bias

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        dt = x.dtype
        step_rows = x.shape[0]
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, (w13, w2) in enumerate(self.experts):
            rows, pos = routed_rows(topk_ids, e)
            if not rows.numel():
                continue
            w = topk_weights[rows, pos, None]
            xe = x[rows] * w.to(dt) if self.weights_on_input else x[rows]
            h = self._product(w13, xe, step_rows).to(dt)
            y = self._product(w2, act_and_mul(layer.activation, h), step_rows).to(dt)
            acc.index_add_(0, rows, y.float() if self.weights_on_input else y.float() * w.float())
        return acc.to(dt)


_MOE_CLASSES: dict[type, type] = {}


def moe_method(config: ResServeConfig, inner: FusedMoEMethodBase, layer, prefix: str) -> ResServeMoEMethod:
    """A :class:`ResServeMoEMethod` over `inner`. vLLM's MoE weight loader picks how to load a
    scale by its method's class name ("ModelOpt…", "…Compressed…"), so the wrapper's class is
    named after the stock method's: ``ResServe<stock class name>``."""
    cls = _MOE_CLASSES.get(type(inner))
    if cls is None:
        name = f"ResServe{type(inner).__name__}"
        cls = type(name, (ResServeMoEMethod,), {"__module__": __name__, "__qualname__": name})
        _MOE_CLASSES[type(inner)] = cls
    return cls(config, inner, layer, prefix)
