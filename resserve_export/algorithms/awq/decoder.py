"""The folds of a decoder model: for each layer, which producer feeds which quantized groups
(Llama, Mistral, Qwen2/3, Gemma 1-3, DeepSeek's MLA, and mixture-of-experts layers)."""

from __future__ import annotations

from resserve_export.algorithms.awq import moe as awq_moe
from resserve_export.algorithms.awq.fold import Fold, o_proj_foldable


def _mla_folds(p: str, attn, norm: str, norm_kind: str) -> tuple[list[Fold], Fold]:
    """DeepSeek's multi-head latent attention `attn` at path `p`: the folds of its input norm and
    of its two latent norms, and that of o_proj into kv_b_proj's value rows."""
    q = f"{p}.q_a_proj" if getattr(attn, "q_a_proj", None) is not None else f"{p}.q_proj"
    folds = [Fold(norm, norm_kind, (q, f"{p}.kv_a_proj_with_mqa"))]
    if getattr(attn, "q_a_layernorm", None) is not None:
        folds.append(Fold(f"{p}.q_a_layernorm", "norm", (f"{p}.q_b_proj",)))
    folds.append(Fold(f"{p}.kv_a_layernorm", "norm", (f"{p}.kv_b_proj",)))
    nope, v = getattr(attn, "qk_nope_head_dim", None), getattr(attn, "v_head_dim", None)
    heads = getattr(attn, "num_heads", None)
    kv_b, o = getattr(attn, "kv_b_proj", None), getattr(attn, "o_proj", None)
    why = None
    if None in (nope, v, heads, kv_b, o) or kv_b.out_features != heads * (nope + v) or o.in_features != heads * v:
        why = "o_proj's input channels are not the value rows of kv_b_proj in a layout this tool knows"
    return folds, Fold(f"{p}.kv_b_proj", "rows", (f"{p}.o_proj",), why, rows=(nope + v, nope) if why is None else None)


def plan_folds(model, blocks=(), shapes: dict | None = None) -> list[Fold]:
    """The folds of a decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 1–3, DeepSeek's MLA, and the
    mixture-of-experts layers of `blocks`, `experts.ExpertBlock` of the checkpoint `shapes`), in
    model order.

    Per layer: the attention input norm → q/k/v (MLA: `_mla_folds`); the norm before the MLP
    (Gemma 2/3's ``pre_feedforward_layernorm``, else ``post_attention_layernorm``) → gate/up (a
    mixture-of-experts layer: every expert's, any shared expert's, and the routers, see `awq_moe`);
    ``v_proj`` → ``o_proj`` where heads allow; ``up_proj`` → ``down_proj`` (per expert)."""

    cfg = getattr(model, "config", None)
    text = getattr(cfg, "text_config", None) or cfg
    one_plus = str(getattr(text, "model_type", "")).startswith("gemma")
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    moe = awq_moe.MoELayers(model, list(blocks), shapes) if blocks else None
    out: list[Fold] = []
    for name, mod in model.named_modules():
        attn, mlp = getattr(mod, "self_attn", None), getattr(mod, "mlp", None)
        if attn is None or mlp is None or not hasattr(mod, "input_layernorm"):
            continue
        norm_kind = "norm_one_plus" if one_plus else "norm"
        p = f"{name}.self_attn"
        if hasattr(attn, "kv_a_proj_with_mqa"):
            attn_folds, o_fold = _mla_folds(p, attn, f"{name}.input_layernorm", norm_kind)
        else:
            attn_folds = [Fold(f"{name}.input_layernorm", norm_kind, (f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"))]
            why = None if o_proj_foldable(heads, kv_heads) else f"grouped-query attention ({heads} query heads share {kv_heads} value heads)"
            o_fold = Fold(f"{p}.v_proj", "rows", (f"{p}.o_proj",), why)
        out += attn_folds
        mlp_norm = f"{name}.pre_feedforward_layernorm" if hasattr(mod, "pre_feedforward_layernorm") else f"{name}.post_attention_layernorm"
        block = moe.block_of(name) if moe is not None else None
        m = f"{name}.mlp"
        if block is not None:
            gate_up, downs = moe.folds(block, mlp_norm, norm_kind)
            out += [gate_up, o_fold, *downs]
        else:
            out += [Fold(mlp_norm, norm_kind, (f"{m}.gate_proj", f"{m}.up_proj")), o_fold, Fold(f"{m}.up_proj", "rows", (f"{m}.down_proj",))]
    return out
