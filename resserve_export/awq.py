"""Activation-aware weight scaling (AWQ) for W4A4: the scale search and the exact folds.

Not wired into the commands yet: these are the pure functions `calibrate --weight-algo awq` and
`pack` will call.

For a group of linears sharing one input ``x`` ``[T, K]`` (q/k/v, gate/up, o_proj, down_proj),
per-input-channel scales ``s`` ``[K]`` leave the product unchanged in real arithmetic:
``x Wᵀ = (x / s)(W · s)ᵀ``. Quantizing ``W · s`` and ``x / s`` instead of ``W`` and ``x`` moves
quantization error between the two operands. The candidates are

    s(α) = mean|x|^α / mean|w|^(1 − α),   normalised by sqrt(max s · min s)

(mean|w| per input channel over every member's rows), for α on a grid; the chosen α minimises the
group's output error under the runtime's own arithmetic: FP4 weights *and* FP4 activations, with
the static activation scale calibrated from the smoothed activations' amax (NVFP4), not the
W4A16 objective of the original AWQ.

The division by ``s`` must happen before the activation is quantized, so it is folded into what
produces ``x``: the RMSNorm weight before q/k/v and gate/up (Gemma's norm multiplies by
``1 + weight``), ``v_proj``'s output rows before ``o_proj`` (only where every query head has its
own value head: with grouped-query attention one value row feeds several ``o_proj`` columns that
would need different scales), ``up_proj``'s output rows before ``down_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import registry
from .formats import qdq
from .mxfp4 import ScaleRounding

GRID = tuple(i / 20 for i in range(21))  # α = 0, 0.05, …, 1 (α = 0: weight-driven; 1: activation-driven)


def candidate_scales(mean_x: torch.Tensor, mean_w: torch.Tensor, alpha: float) -> torch.Tensor:
    """s(α) ``[K]`` (float32), normalised so that max s · min s = 1."""
    mx = mean_x.float().clamp(min=1e-8)
    mw = mean_w.float().clamp(min=1e-8)
    s = mx.pow(alpha) / mw.pow(1.0 - alpha)
    return (s / (s.max() * s.min()).sqrt()).float()


def group_error(
    x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, fmt: str, rounding: ScaleRounding | str = ScaleRounding.CEIL
) -> tuple[float, float]:
    """(Σ‖Y_q − Y‖², Σ‖Y‖²) of a group under W4A4 with scales `s`: Y = x Wᵀ in FP32 of the
    original operands; Y_q = Q_a(x / s) Q_w(W · s)ᵀ, where Q_w uses the fused group's one tensor
    scale and Q_a the static activation scale of amax(x / s) (what `pack` derives from a
    calibration of the smoothed activations)."""
    f = registry.get(fmt)
    xs = x.float() / s
    ws = [w.float() * s for w in weights]
    alpha_w = f.weight_alpha(ws)
    alpha_x = f.input_alpha(xs.abs().amax())
    xq = qdq(xs, f, alpha=alpha_x, rounding=rounding, backend="reference")
    err = ref = 0.0
    for w, w_s in zip(weights, ws):
        y = x.float() @ w.float().T
        yq = xq @ qdq(w_s, f, alpha=alpha_w, rounding=rounding, backend="reference").T
        err += float((yq - y).double().square().sum())
        ref += float(y.double().square().sum())
    return err, ref


@dataclass
class SearchResult:
    alpha: float
    scales: torch.Tensor  # [K] float32
    errors: dict[float, float]  # α -> relative output error (NMSE) on the search rows


def search(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    fmt: str,
    *,
    mean_x: torch.Tensor | None = None,
    grid: tuple[float, ...] = GRID,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
) -> SearchResult:
    """The α of `grid` whose scales minimise `group_error` on the rows `x` ``[T, K]``; ties go to
    the smaller α. `mean_x`: the calibration's mean |x| per channel (default: of `x`). No
    smoothing (all scales 1) is scored too: when no α beats it, the result's α is NaN and its
    scales are ones."""
    mean_x = x.float().abs().mean(0) if mean_x is None else mean_x
    mean_w = torch.cat([w.float().abs() for w in weights], dim=0).mean(0)
    best_alpha, best_s, best = float("nan"), torch.ones_like(mean_w), None
    e, r = group_error(x, weights, best_s, fmt, rounding)
    best = e / r if r > 0 else float("inf")
    errors = {}
    for a in grid:
        s = candidate_scales(mean_x, mean_w, a)
        e, r = group_error(x, weights, s, fmt, rounding)
        errors[a] = e / r if r > 0 else float("inf")
        if errors[a] < best:
            best_alpha, best_s, best = a, s, errors[a]
    return SearchResult(best_alpha, best_s, errors)


# ----------------------------------------------------------------------------- exact folds


def fold_into_norm(norm_weight: torch.Tensor, s: torch.Tensor, *, one_plus: bool = False) -> torch.Tensor:
    """The norm weight that outputs ``x / s``: ``w / s``; Gemma-style norms (``(1 + w) · x̂``):
    ``(1 + w) / s − 1``."""
    w = norm_weight.float()
    out = (1.0 + w) / s - 1.0 if one_plus else w / s
    return out.to(norm_weight.dtype)


def fold_into_rows(weight: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None):
    """(weight, bias) of the linear producing the scaled input: output rows divided by `s`."""
    w = (weight.float() / s[:, None]).to(weight.dtype)
    b = None if bias is None else (bias.float() / s).to(bias.dtype)
    return w, b


def scale_columns(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A consumer's weight with its input channels multiplied by `s`."""
    return (weight.float() * s[None, :]).to(weight.dtype)


def o_proj_foldable(num_heads: int, num_kv_heads: int) -> bool:
    """Whether o_proj's input scales fold into v_proj: each o_proj input channel must come from
    its own v_proj row (no grouped-query sharing)."""
    return num_heads == num_kv_heads


@dataclass(frozen=True)
class Fold:
    """Where one group's scales go: `producer` (a norm or a linear) divides its output by s,
    `consumers` multiply their input channels by s; `unscaled` says why a group is left alone."""

    producer: str
    kind: str  # "norm" | "norm_one_plus" | "rows"
    consumers: tuple[str, ...]
    unscaled: str | None = None


def plan_folds(model) -> list[Fold]:
    """The folds of a dense decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 1–3), in model order.

    Per layer: the attention input norm → q/k/v; the norm before the MLP (Gemma 2/3's
    ``pre_feedforward_layernorm``, else ``post_attention_layernorm``) → gate/up; ``v_proj`` →
    ``o_proj`` where heads allow; ``up_proj`` → ``down_proj``."""
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "text_config", None) or cfg
    one_plus = str(getattr(text, "model_type", "")).startswith("gemma")
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    out: list[Fold] = []
    for name, mod in model.named_modules():
        attn, mlp = getattr(mod, "self_attn", None), getattr(mod, "mlp", None)
        if attn is None or mlp is None or not hasattr(mod, "input_layernorm"):
            continue
        norm_kind = "norm_one_plus" if one_plus else "norm"
        p = f"{name}.self_attn"
        out.append(Fold(f"{name}.input_layernorm", norm_kind, (f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj")))
        mlp_norm = "pre_feedforward_layernorm" if hasattr(mod, "pre_feedforward_layernorm") else "post_attention_layernorm"
        m = f"{name}.mlp"
        out.append(Fold(f"{name}.{mlp_norm}", norm_kind, (f"{m}.gate_proj", f"{m}.up_proj")))
        why = None if o_proj_foldable(heads, kv_heads) else f"grouped-query attention ({heads} query heads share {kv_heads} value heads)"
        out.append(Fold(f"{p}.v_proj", "rows", (f"{p}.o_proj",), why))
        out.append(Fold(f"{m}.up_proj", "rows", (f"{m}.down_proj",)))
    return out


@torch.no_grad()
def apply_fold(model, fold: Fold, s: torch.Tensor) -> None:
    """Scale `model` in place: the producer's output divided by `s`, the consumers' inputs
    multiplied by it (exact in real arithmetic)."""
    if fold.unscaled is not None:
        raise ValueError(f"{fold.consumers[0]} cannot be scaled: {fold.unscaled}")
    mods = dict(model.named_modules())
    prod = mods[fold.producer]
    s = s.to(prod.weight.device)
    if fold.kind.startswith("norm"):
        prod.weight.copy_(fold_into_norm(prod.weight, s, one_plus=fold.kind == "norm_one_plus"))
    else:
        w, b = fold_into_rows(prod.weight, s, prod.bias)
        prod.weight.copy_(w)
        if b is not None:
            prod.bias.copy_(b)
    for c in fold.consumers:
        mods[c].weight.copy_(scale_columns(mods[c].weight, s))


__all__ = [
    "GRID", "SearchResult", "candidate_scales", "group_error", "search", "fold_into_norm", "fold_into_rows",
    "scale_columns", "o_proj_foldable", "Fold", "plan_folds", "apply_fold",
]
