"""`size`: bytes of a packed checkpoint from ``config.json`` alone (docs/formats.md, the end of "The
extended weight (K-Ext)").

The tensor names and shapes a decoder (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts
Qwen3-MoE and Mixtral, per-expert as their checkpoints name them) saves are derived
from its config (for the families with an adapter, vision-language and hybrid, from transformers'
own model of the family built without weights), then fed to the very layout function `pack` uses, so the safetensors files
(headers included), their index files and ``hf_quant_config.json`` are counted exactly. Per
quantized linear ``[N, K]`` this is the formula of docs/formats.md: NVFP4 ``N·K/2 + N·K/16 + 8`` (the 8 are
weight_scale_2 and input_scale), MXFP4 ``N·K/2 + N·K/32``; extension the same over K_E (it
shares the base scalars), plus ``K/8`` mask bytes. Tied embeddings are stored once.
``config.json``, tokenizer and other copied files are the caller's `other_bytes`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from resserve_export import __version__
from resserve_export.core.errors import UserError
from resserve_export.modeling import families, modelio
from resserve_export.modeling.experts import expert_blocks, routers
from resserve_export.modeling.groups import exact_linears
from resserve_export.stages.layout import (
    OWN_FILES,
    WEIGHT_SUFFIXES,
    build_layout,
    model_groups,
)
from resserve_export.stages.pack.inputs import check_experts_layout, check_format_arg, load_ratios
from resserve_export.storage.checkpoint import (
    MODEL_PREFIX,
    SIDECAR_PREFIX,
    dump_json,
)
from resserve_export.storage.hub_experts import HUB
from resserve_export.storage.safetensors import ST_METADATA, header_bytes, index_json, parse_size

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")
_MOE = ("qwen3_moe", "mixtral", "deepseek_v3")
_ST_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_ST_INT = {torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL", torch.int8: "I8"}


def shapes_from_config(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{tensor name: (safetensors dtype, shape)}`` of the bf16 checkpoint `cfg` describes: by
    formula for the generic decoders (`SUPPORTED`), from transformers' own model of the family
    for the families with an adapter (`modeling.families`: vision-language, hybrid)."""
    mt = cfg.get("model_type")
    if mt not in SUPPORTED and families.has_adapter(cfg):
        return shapes_from_transformers(cfg)
    if mt not in SUPPORTED:
        raise UserError(
            f"size knows the tensor layout of {', '.join(SUPPORTED)} configs and of the families in the README, not {mt!r}: "
            "pack the model and run `inspect` instead"
        )
    if mt not in _MOE and (cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")):
        raise UserError(f"size knows the experts of {', '.join(_MOE)} configs, not of {mt!r}: pack the model and run `inspect` instead")
    try:
        H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
        nh, V = cfg["num_attention_heads"], cfg["vocab_size"]
    except KeyError as e:
        raise UserError(f"config lacks {e.args[0]!r}: pass the model's config.json") from None
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    dt = _ST_DTYPE.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "BF16")
    qkv_bias = bool(cfg.get("attention_bias", False)) or mt == "qwen2"
    o_bias = bool(cfg.get("attention_bias", False)) and mt != "qwen2"
    mlp_bias = bool(cfg.get("mlp_bias", False))
    out: dict[str, tuple[str, tuple[int, ...]]] = {"model.embed_tokens.weight": (dt, (V, H)), "model.norm.weight": (dt, (H,))}
    # Llama, Mistral, Qwen2 and Qwen3 configs default to untied embeddings.
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (dt, (V, H))
    for i in range(L):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (dt, (H,))
        out[f"{p}.post_attention_layernorm.weight"] = (dt, (H,))
        mlp = _experts(cfg, i, H, dt) or [("mlp.gate_proj", I, H, mlp_bias), ("mlp.up_proj", I, H, mlp_bias), ("mlp.down_proj", H, I, mlp_bias)]
        if mt == "deepseek_v3":
            attention = _mla(cfg, p, H, nh, dt, out)
        else:
            attention = [
                ("self_attn.q_proj", nh * hd, H, qkv_bias),
                ("self_attn.k_proj", nkv * hd, H, qkv_bias),
                ("self_attn.v_proj", nkv * hd, H, qkv_bias),
                ("self_attn.o_proj", H, nh * hd, o_bias),
            ]
        for name, n, k, bias in (*attention, *mlp):
            if k == 0:  # a vector: DeepSeek's router correction bias
                out[f"{p}.{name}"] = (dt, (n,))
                continue
            out[f"{p}.{name}.weight"] = (dt, (n, k))
            if bias:
                out[f"{p}.{name}.bias"] = (dt, (n,))
        if mt in ("qwen3", "qwen3_moe"):
            out[f"{p}.self_attn.q_norm.weight"] = (dt, (hd,))
            out[f"{p}.self_attn.k_norm.weight"] = (dt, (hd,))
    return out


def shapes_from_transformers(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors a checkpoint of `cfg` holds on disk, from transformers' model of its family
    built without weights (meta device) and named as transformers saves it (its load-time renaming
    reversed: ``language_model.model.layers.…`` for Gemma 3, ``backbone.…`` for Nemotron-H), with the
    family's hub names where they differ (`Family.disk_names`)."""
    import transformers  # 3-5 s: only `size` of an adapter family pays it
    from accelerate import init_empty_weights
    from transformers.core_model_loading import revert_weight_conversion

    mt = cfg.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(**_special_floats(cfg))
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"transformers {transformers.__version__} cannot read a {mt!r} config ({e}): pass the model's config.json") from None
    with init_empty_weights(include_buffers=False):
        model = modelio.build_empty(cfg, config)
    # Tied parameters once, under the name save_pretrained keeps: on the meta device nothing is
    # tied yet, so the tied targets (`lm_head.weight` for tied embeddings) are dropped by name.
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    tensors = {n: p for n, p in model.named_parameters(remove_duplicate=True) if n not in tied}
    tensors.update({n: b for n, b in model.named_buffers() if n.rpartition(".")[2] not in _non_persistent(model, n)})
    on_disk = revert_weight_conversion(model, tensors)
    for prefix, hub in families.family_of(cfg).disk_names:
        on_disk = {hub + n[len(prefix):] if n.startswith(prefix) else n: t for n, t in on_disk.items()}
    text = cfg.get("text_config") or {}
    dt = _ST_DTYPE.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or text.get("dtype") or text.get("torch_dtype") or "bfloat16"), "BF16")
    return {n: (dt if t.is_floating_point() else _ST_INT[t.dtype], tuple(t.shape)) for n, t in on_disk.items()}


def _special_floats(obj):
    """`obj` with the non-finite floats transformers writes into config.json as
    ``{"__float__": "Infinity"}`` (Nemotron-H's ``time_step_limit``) read back as floats."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(obj["__float__"].lower().replace("infinity", "inf"))
        return {k: _special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_special_floats(v) for v in obj]
    return obj


def _non_persistent(model, name: str) -> set[str]:
    owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return set(getattr(owner, "_non_persistent_buffers_set", ()))


def _experts(cfg: dict, layer: int, H: int, dt: str) -> list[tuple[str, int, int, bool]]:
    """A sparse layer's router and per-expert projections as the checkpoint names them (empty
    for a dense layer): Qwen3-MoE ``mlp.experts.E.{gate,up,down}_proj`` and ``mlp.gate``,
    Mixtral ``block_sparse_moe.experts.E.w{1,3,2}`` and ``block_sparse_moe.gate``."""
    mt = cfg["model_type"]
    if mt == "qwen3_moe":
        # hub configs say num_experts, transformers 5 saves num_local_experts
        E, I = cfg.get("num_experts") or cfg.get("num_local_experts") or 0, cfg.get("moe_intermediate_size")
        step = cfg.get("decoder_sparse_step") or 1
        if not E or layer in (cfg.get("mlp_only_layers") or []) or (layer + 1) % step:
            return []
        root, leaves = "mlp", ("gate_proj", "up_proj", "down_proj")
    elif mt == "mixtral":
        E, I = cfg.get("num_local_experts") or 0, cfg.get("intermediate_size")
        root, leaves = "block_sparse_moe", ("w1", "w3", "w2")
    elif mt == "deepseek_v3":
        E, I = cfg.get("n_routed_experts") or 0, cfg.get("moe_intermediate_size")
        if not E or layer < (cfg.get("first_k_dense_replace") or 0) or layer % (cfg.get("moe_layer_freq") or 1):
            return []
        root, leaves = "mlp", ("gate_proj", "up_proj", "down_proj")
        shared = (cfg.get("n_shared_experts") or 0) * (I or 0)
        out = [("mlp.gate", E, H, False), ("mlp.gate.e_score_correction_bias", E, 0, False)]
        if shared:
            out += [("mlp.shared_experts.gate_proj", shared, H, False), ("mlp.shared_experts.up_proj", shared, H, False)]
            out.append(("mlp.shared_experts.down_proj", H, shared, False))
        for e in range(E):
            out += [(f"{root}.experts.{e}.{leaves[0]}", I, H, False), (f"{root}.experts.{e}.{leaves[1]}", I, H, False)]
            out.append((f"{root}.experts.{e}.{leaves[2]}", H, I, False))
        return out
    else:
        return []
    if not isinstance(I, int) or not E:
        raise UserError("config declares experts without their sizes (num_experts / moe_intermediate_size): pass the model's config.json")
    out = [(f"{root}.gate", E, H, False)]
    for e in range(E):
        out += [(f"{root}.experts.{e}.{leaves[0]}", I, H, False), (f"{root}.experts.{e}.{leaves[1]}", I, H, False)]
        out.append((f"{root}.experts.{e}.{leaves[2]}", H, I, False))
    return out


def _mla(cfg: dict, p: str, H: int, nh: int, dt: str, out: dict) -> list[tuple[str, int, int, bool]]:
    """DeepSeek-V3's multi-head latent attention projections (norms of the low-rank paths go
    straight into `out`)."""
    try:
        r_kv, rope, nope, vd = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    except KeyError as e:
        raise UserError(f"config lacks {e.args[0]!r}: pass the model's config.json") from None
    r_q = cfg.get("q_lora_rank")
    if r_q:
        q = [("self_attn.q_a_proj", r_q, H, False), ("self_attn.q_b_proj", nh * (nope + rope), r_q, False)]
        out[f"{p}.self_attn.q_a_layernorm.weight"] = (dt, (r_q,))
    else:
        q = [("self_attn.q_proj", nh * (nope + rope), H, False)]
    out[f"{p}.self_attn.kv_a_layernorm.weight"] = (dt, (r_kv,))
    return [
        *q,
        ("self_attn.kv_a_proj_with_mqa", r_kv + rope, H, False),
        ("self_attn.kv_b_proj", nh * (nope + vd), r_kv, False),
        ("self_attn.o_proj", H, nh * vd, False),
    ]


@dataclass
class SizeReport:
    """Bytes per class; `total` sums them. GiB = 2³⁰ bytes."""

    fmt: str
    classes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.classes.values())

    def as_dict(self) -> dict:
        return {"format": self.fmt, "classes": dict(self.classes), "total": self.total, "total_gib": self.total / 2**30}


def estimate(
    cfg: dict,
    fmt: str,
    *,
    ratio: float | None = None,
    plan: str | os.PathLike | None = None,
    other_bytes: int = 0,
    max_shard_size: str | int = "5GB",
    kv_cache: str = "none",
    experts_layout: str = "per-expert",
) -> SizeReport:
    """Exact bytes `pack` writes for this config, format and ratio / plan (+ `other_bytes`),
    with the KV-cache scales of `kv_cache` (``none``, ``fp8``, ``nvfp4``) as `pack --kv-cache`
    and the experts in `experts_layout` as `pack --experts-layout`."""
    f = check_format_arg(fmt)
    hub = check_experts_layout(experts_layout, f.name, ratio, plan, kv_cache) == HUB
    families.check_experts_layout(cfg, experts_layout, "estimated")
    shapes = families.unfused_shapes(cfg, shapes_from_config(cfg))  # experts fused on disk: quantized per expert
    groups = model_groups(shapes)
    families.check_format(cfg, fmt, "estimated")
    ratios, _ = load_ratios(groups, ratio, Path(plan) if plan is not None else None, None)
    layout = build_layout(
        shapes, groups, ratios, fmt, cfg.get("tie_word_embeddings") is True, kv_cache, families.writes_fused_experts(cfg) and not hub, experts_layout
    )
    max_bytes = parse_size(max_shard_size)
    model_shards, side_shards = layout.shards(max_bytes)
    classes = {"embeddings": 0, "norms & biases": 0, "quantized linears": 0, "extension": 0, "masks": 0}
    if kv_cache != "none":
        classes["kv-cache scales"] = 0
    for s in layout.model + layout.sidecar:
        c = layout.tensor_class[s.name]
        if c == "unquantized":
            c = "embeddings" if s.name.endswith(("embed_tokens.weight", "lm_head.weight")) else "norms & biases"
        elif c == "linear":
            c = "quantized linears"
        elif c == "mask":
            c = "masks"
        elif c == "kv_scale":
            c = "kv-cache scales"
        classes[c] += s.nbytes
    headers = sum(len(header_bytes(sh, ST_METADATA)) for sh in model_shards + side_shards)
    meta = len(dump_json(index_json(MODEL_PREFIX, model_shards)))
    if side_shards:
        meta += len(dump_json(index_json(SIDECAR_PREFIX, side_shards)))
    ignore = ["lm_head", *routers(shapes, expert_blocks(shapes)), *exact_linears(shapes)]
    meta += sum(len(dump_json(obj)) for obj in ({} if hub else f.extra_files(ignore, __version__, kv_cache)).values())
    classes["safetensors headers"] = headers
    classes["index / quant json"] = meta
    classes["config, tokenizer, other files"] = int(other_bytes)
    return SizeReport(fmt, classes)


def other_files_bytes(model_dir: Path) -> int:
    """Bytes of the non-weight files `pack` copies from a model directory (config.json included)."""

    total = 0
    for p in sorted(Path(model_dir).iterdir()):
        if p.is_file() and not p.name.startswith(".") and (p.name == "config.json" or p.name not in OWN_FILES) and not p.name.endswith(WEIGHT_SUFFIXES):
            total += p.stat().st_size
    return total


def load_config(path: str | os.PathLike) -> tuple[dict, Path | None]:
    """(config dict, model dir or None) from a config.json path or a model directory."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise UserError(f"{path} does not exist: pass a config.json or a model directory")
    try:
        cfg = json.loads(p.read_text())
    except ValueError:
        raise UserError(f"{p} is not valid JSON: pass the model's config.json") from None
    if "text_config" in cfg and "hidden_size" not in cfg and not families.has_adapter(cfg):
        cfg = cfg["text_config"]
    return cfg, p.parent


__all__ = ["estimate", "shapes_from_config", "SizeReport", "other_files_bytes", "load_config"]
