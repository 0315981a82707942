"""Where a smoothing scale goes: a `Fold` divides a producer's output (a norm, or the rows of a
linear) by s and multiplies its consumers' input columns by s, exact in real arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def fold_into_norm(norm_weight: torch.Tensor, s: torch.Tensor, *, one_plus: bool = False) -> torch.Tensor:
    """The norm weight that outputs ``x / s``: ``w / s``; Gemma-style norms (``(1 + w) · x̂``):
    ``(1 + w) / s − 1``."""
    w = norm_weight.float()
    out = (1.0 + w) / s - 1.0 if one_plus else w / s
    return out.to(norm_weight.dtype)


def realized_norm_scales(norm_weight: torch.Tensor, s: torch.Tensor, *, one_plus: bool = False) -> torch.Tensor:
    """The per-channel scales a norm stored in its dtype (`norm_weight`'s) really applies.

    Folding rounds ``w / s`` (Gemma: ``(1 + w) / s − 1``) to the norm's dtype; for Gemma's form
    the subtraction cancels, and in bf16 a channel's effective factor can move by tens of percent
    from 1 / s. The consumers must be multiplied by the factor the stored norm applies, so the
    scales are replaced by ``w / w'`` (``(1 + w) / (1 + w')``) of the stored ``w'``; a channel
    where that is not a positive finite number keeps scale 1."""
    w = norm_weight.float()
    stored = fold_into_norm(norm_weight, s.to(norm_weight.device), one_plus=one_plus).float()
    s_eff = (1.0 + w) / (1.0 + stored) if one_plus else w / stored
    ok = torch.isfinite(s_eff) & (s_eff > 0)
    return torch.where(ok, s_eff, torch.ones_like(s_eff)).float()


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
    `consumers` (the quantized linears reading it: one decision group, or several) multiply their
    input channels by s; `readers`: unquantized linears reading the same output (a mixture-of-experts
    layer's routers), whose columns are multiplied by s too but which the search does not score;
    `rows`: for a linear producer whose output only partly is the consumers' input, ``(stride,
    offset)``: its rows ``offset … stride − 1`` of every block of `stride` are (MLA's value rows of
    ``kv_b_proj``), None when all are; `unscaled` says why a group is left alone."""

    producer: str
    kind: str  # "norm" | "norm_one_plus" | "rows"
    consumers: tuple[str, ...]
    unscaled: str | None = None
    readers: tuple[str, ...] = ()
    rows: tuple[int, int] | None = None


def producer_row_scales(fold: Fold, s: torch.Tensor) -> torch.Tensor:
    """The scales dividing a "rows" fold's producer rows: `s` itself, or with `Fold.rows` the
    consumers' scales at their rows of every block and 1 (no change) at the others."""
    if fold.rows is None:
        return s
    stride, offset = fold.rows
    full = torch.ones(s.numel() // (stride - offset), stride, dtype=s.dtype, device=s.device)
    full[:, offset:] = s.reshape(full.shape[0], stride - offset)
    return full.reshape(-1)


def fold_groups(fold: Fold, group_of: dict[str, tuple[str, ...]]) -> list[tuple[str, ...]] | None:
    """The decision groups a fold's consumers make up, in order, or None when they are not whole
    quantized groups (a consumer left unquantized, or a group only partly among them)."""
    out: list[tuple[str, ...]] = []
    for c in fold.consumers:
        g = group_of.get(c)
        if g is None:
            return None
        if g not in out:
            out.append(g)
    return out if {m for g in out for m in g} == set(fold.consumers) else None
