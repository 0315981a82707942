"""What a checkpoint will contain, from the source's tensor headers alone.

`build_layout` lists every output tensor (name, dtype, shape) in write order, the work items
that produce them and the per-group records of ``quantization_config.resserve``: `pack` writes
exactly this, and `size` counts it without any weights. Which source files `pack` copies
verbatim is decided here too (`OWN_FILES`, `WEIGHT_SUFFIXES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from resserve_export.algorithms.kext import ext_width
from resserve_export.core.errors import UserError
from resserve_export.core.names import (
    EXT_SCALE_SUFFIX,
    EXT_WEIGHT_SUFFIX,
    MASK_SUFFIX,
    natural_key,
)
from resserve_export.formats import kv as kv_format
from resserve_export.formats import registry
from resserve_export.formats.constants import SELECTION_GROUP
from resserve_export.formats.registry import HF_QUANT_CONFIG
from resserve_export.modeling import attention as attention_layers
from resserve_export.modeling.experts import expert_blocks
from resserve_export.modeling.groups import Group, group_linears, linears_from_shapes
from resserve_export.storage import fused_experts, hub_experts
from resserve_export.storage.checkpoint import (
    MODEL_INDEX,
    SIDECAR_INDEX,
)
from resserve_export.storage.safetensors import TensorSpec, split_shards

# Files of a source model that are weights or that `pack` writes itself: never copied.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt", ".onnx")
OWN_FILES = {"config.json", MODEL_INDEX, SIDECAR_INDEX, HF_QUANT_CONFIG, "pytorch_model.bin.index.json"}
_FLOAT_DTYPES = {"BF16", "F16", "F32"}


@dataclass
class Layout:
    """Every output tensor in write order, the work items producing them, and group records."""

    fmt: str
    items: list[tuple[str, object]]  # ("copy", name) | ("group", Group) | ("kv", name)
    model: list[TensorSpec]
    sidecar: list[TensorSpec]
    groups: list[dict]
    tensor_class: dict[str, str] = field(default_factory=dict)
    written_fused: bool = False  # experts written fused per expert (`storage.fused_experts`)
    hub_experts: dict[str, int] = field(default_factory=dict)  # experts in the hub's layout: {<…>.experts: E} (`storage.hub_experts`)

    def shards(self, max_bytes: int) -> tuple[list[list[TensorSpec]], list[list[TensorSpec]]]:
        return split_shards(self.model, max_bytes), split_shards(self.sidecar, max_bytes)


def _member_specs(fmt: str, module: str, N: int, K: int, ratio: float) -> tuple[list[TensorSpec], list[TensorSpec]]:
    f = registry.get(fmt)
    plain = [TensorSpec(*spec) for spec in f.base_specs(module, N, K)]
    side: list[TensorSpec] = []
    if ratio > 0:
        side.append(TensorSpec(f"{module}.{MASK_SUFFIX}", "U8", (K // SELECTION_GROUP,)))
    K_E = ext_width(K, ratio, f)
    if K_E:
        side.append(TensorSpec(f"{module}.{EXT_WEIGHT_SUFFIX}", "U8", (N, K_E // 2)))
        side.append(TensorSpec(f"{module}.{EXT_SCALE_SUFFIX}", f.scale_st_dtype, (N, K_E // f.block)))
    return plain, side


def kv_specs(shapes: dict[str, tuple[str, tuple[int, ...]]], fmt: str, kv_cache: str) -> dict[str, TensorSpec]:
    """The KV-cache scale tensors of a checkpoint in format `fmt` with KV-cache format `kv_cache`
    (none for ``none``): a k and a v scale per attention module of the headers."""

    if kv_format.check_for_format(kv_cache, fmt) == "none":
        return {}
    f = registry.get(fmt)
    attention = attention_layers.attention_modules(shapes)
    if not attention:
        raise UserError("the model has no attention layers with k_proj / v_proj: it cannot carry KV-cache scales; use --kv-cache none")
    out = {}
    for a in attention:
        for name in kv_format.scale_names(a, f.kv_style):
            out[name] = TensorSpec(name, "F32", kv_format.scale_shape(f.kv_style))
    return out


def model_groups(shapes: dict[str, tuple[str, tuple[int, ...]]]) -> list[Group]:
    """Decision groups of a checkpoint from its headers (what `size` estimates from a config);
    per expert, gate+up and down (expert layouts that cannot be quantized completely are refused)."""
    expert_blocks(shapes)
    linears = linears_from_shapes(shapes)
    return group_linears({m: linears[m] for m in sorted(linears, key=natural_key)})


def recorded_groups(members: list[list[str]], shapes: dict[str, tuple[str, tuple[int, ...]]]) -> list[Group]:
    """The decision groups `calibrate` recorded (its one rule for which modules are quantized
    linears and which share an input), checked against the source's headers `shapes`."""
    groups = []
    for ms in members:
        dims = []
        for m in ms:
            spec = shapes.get(f"{m}.weight")
            if spec is None or len(spec[1]) != 2:
                raise UserError(f"the calibration lists {m}, which has no 2-D weight in this model: calibrate this model")
            dims.append(tuple(spec[1]))
        if len({k for _, k in dims}) != 1:
            raise UserError(f"the calibration groups {', '.join(ms)}, whose input widths differ in this model: calibrate this model")
        groups.append(Group(tuple(ms), dims[0][1], tuple(n for n, _ in dims)))
    return groups


def build_layout(
    shapes: dict[str, tuple[str, tuple[int, ...]]],
    groups: list[Group],
    ratios: dict[str, float],
    fmt: str,
    tied: bool,
    kv_cache: str = "none",
    written_fused: bool = False,
    experts_layout: str = "per-expert",
) -> Layout:
    """The output layout for source tensors `shapes` (name -> (dtype, shape)).

    Order is canonical (natural sort of source and KV-scale names, a group's outputs at its
    first member), so the same inputs always give the same files. `ratios` maps ``group.name``
    to ρ. With a `kv_cache` format other than ``none`` every attention module gets its k / v
    scales, named and shaped as the format's loaders read them. `written_fused`: experts are
    written fused per expert (`storage.fused_experts`: gpt-oss). `experts_layout` ``hub``: only
    the experts are quantized (every other group is copied as it is), each layer's written as the
    hub's four MXFP4 tensors (`storage.hub_experts`) at the position of its last group.
    """
    b = registry.get(fmt).block
    hub: dict[str, int] = {}
    if experts_layout == hub_experts.HUB:
        groups = [g for g in groups if all(hub_experts.expert_linear(m) for m in g.modules)]
        hub = hub_experts.per_layer(m for g in groups for m in g.modules)
    hub_seen: dict[str, int] = {}
    hub_dims: dict[str, dict[str, int]] = {}
    member_of = {m: g for g in groups for m in g.modules}
    items: list[tuple[str, object]] = []
    model: list[TensorSpec] = []
    sidecar: list[TensorSpec] = []
    cls: dict[str, str] = {}
    records: list[dict] = []
    done: set[str] = set()
    kv = kv_specs(shapes, fmt, kv_cache)
    names = sorted([*shapes, *kv], key=natural_key)
    has_embed = any(n.endswith("embed_tokens.weight") for n in names)
    for name in names:
        if name in kv:
            items.append(("kv", name))
            model.append(kv[name])
            cls[name] = "kv_scale"
            continue
        dtype, shape = shapes[name]
        if tied and name == "lm_head.weight" and has_embed:
            continue  # tied embeddings are stored once
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        g = member_of.get(mod) if mod else None
        if g is None:
            items.append(("copy", name))
            model.append(TensorSpec(name, dtype, tuple(shape)))
            cls[name] = "unquantized"
            continue
        if g.name in done:
            continue
        done.add(g.name)
        K = g.in_features
        bad = [m for m in g.modules if shapes[f"{m}.weight"][0] not in _FLOAT_DTYPES]
        if bad:
            raise UserError(f"{bad[0]}.weight has dtype {shapes[bad[0] + '.weight'][0]}: pack needs bf16/fp16/fp32 weights")
        if K % b:
            raise UserError(
                f"{', '.join(g.modules)}: in_features {K} is not a multiple of the {fmt} block size {b}; "
                "this model cannot be packed in that format"
            )
        ratio = ratios[g.name]
        K_E = ext_width(K, ratio, fmt)
        plain: list[TensorSpec] = []
        for m, N in zip(g.modules, g.out_features):
            member, side = _member_specs(fmt, m, N, K, ratio)
            plain += member
            sidecar += side
            for s in side:
                cls[s.name] = "mask" if s.name.endswith(MASK_SUFFIX) else "extension"
        plain = fused_experts.merged_specs(plain) if written_fused else plain
        if hub:
            plain = []
            for m, N in zip(g.modules, g.out_features):
                experts, _, leaf = hub_experts.expert_linear(m)
                if leaf == "gate_proj":
                    hub_dims.setdefault(experts, {}).update(I=N, H=K)
                hub_seen[experts] = hub_seen.get(experts, 0) + 1
                if hub_seen[experts] == 3 * hub[experts]:  # the layer's last expert linear: its four tensors
                    plain = hub_experts.hub_specs(experts, hub[experts], hub_dims[experts]["I"], hub_dims[experts]["H"])
        model += plain
        for s in plain:
            cls[s.name] = "linear"
        items.append(("group", g))
        mode = "plain" if ratio == 0 else ("full" if ratio == 1 else "k_ext")
        records.append({"members": list(g.modules), "ratio": ratio, "mode": mode, "K": K, "K_E": K_E})
    return Layout(fmt, items, model, sidecar, records, cls, written_fused, hub)


__all__ = ["Layout", "build_layout", "kv_specs", "model_groups", "recorded_groups", "OWN_FILES", "WEIGHT_SUFFIXES"]
