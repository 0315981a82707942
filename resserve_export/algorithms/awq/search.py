"""The AWQ search for one group: candidate per-channel scales s = mean|x|^a / mean|w|^(1-a) over a
grid of a, each scored by the group's linear-output error under W4A4 with the scales folded in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from resserve_export.formats import registry
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.ops import qdq

GRID = tuple(i / 20 for i in range(21))  # α = 0, 0.05, …, 1 (α = 0: weight-driven; 1: activation-driven)


def candidate_scales(mean_x: torch.Tensor, mean_w: torch.Tensor, alpha: float) -> torch.Tensor:
    """s(α) ``[K]`` (float32), normalised so that max s · min s = 1."""
    mx = mean_x.float().clamp(min=1e-8)
    mw = mean_w.float().clamp(min=1e-8)
    s = mx.pow(alpha) / mw.pow(1.0 - alpha)
    return (s / (s.max() * s.min()).sqrt()).float()


def group_error(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    s: torch.Tensor,
    fmt: str,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    *,
    y_ref: torch.Tensor | None = None,
    backend: str = "auto",
    amax: torch.Tensor | None = None,
) -> tuple[float, float]:
    """(Σ‖Y_q − Y‖², Σ‖Y‖²) of a group under W4A4 with scales `s`: Y = x Wᵀ in FP32 of the
    original operands (the members' outputs side by side; `y_ref` when already computed);
    Y_q = Q_a(x / s) Q_w(W · s)ᵀ, where Q_w uses the fused group's one tensor scale and Q_a the
    static activation scale of amax(x / s) (what `pack` derives from a calibration of the smoothed
    activations). `backend`: the quantizer's (`formats.quantize`; every backend is bit-exact).
    `amax`: the per-channel max |x| ``[K]`` of the rows the static scale is calibrated on when
    they are not `x` (an expert measured on its routed tokens whose scale comes from every token):
    the scale is then that of max(amax / s), which is max |rows / s| exactly."""
    f = registry.get(fmt)
    s = s.to(x.device)
    xs = x.float() / s
    ws = [w.float() * s for w in weights]
    alpha_w = f.weight_alpha(ws)
    alpha_x = f.input_alpha(xs.abs().amax() if amax is None else (amax.to(x.device).float() / s).amax())
    xq = qdq(xs, f, alpha=alpha_x, rounding=rounding, backend=backend)
    wq = torch.cat([qdq(w, f, alpha=alpha_w, rounding=rounding, backend=backend) for w in ws])
    if y_ref is None:
        y_ref = x.float() @ torch.cat([w.float() for w in weights]).T
    err = float((xq @ wq.T - y_ref).double().square().sum())
    return err, float(y_ref.double().square().sum())


@dataclass
class SearchResult:
    alpha: float
    scales: torch.Tensor  # [K] float32
    errors: dict[float, float]  # α -> relative output error (NMSE) on the search rows
    unsmoothed: float = float("nan")  # the same error without smoothing (all scales 1)


@dataclass
class Part:
    """One decision group of a fold, as the search sees it: its input rows ``[T, K]``, its
    members' weights, and (`group_error`'s `amax`) the per-channel amax its static activation
    scale comes from when that is not of `x`."""

    x: torch.Tensor
    weights: list[torch.Tensor]
    amax: torch.Tensor | None = None


def mean_abs_weight(parts: list[Part]) -> torch.Tensor:
    """mean |w| per input channel over every row of the parts' weights (float32 ``[K]``): of one
    group, the float32 mean of its rows; of several (a layer's experts), float64 sums per weight,
    which need no copy of them all."""
    weights = [w for p in parts for w in p.weights]
    if len(parts) == 1:
        return torch.cat([w.float().abs() for w in weights], dim=0).mean(0)
    total = sum(w.abs().sum(0, dtype=torch.float64) for w in weights)
    return (total / sum(w.shape[0] for w in weights)).float()


def search(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    fmt: str,
    *,
    mean_x: torch.Tensor | None = None,
    grid: tuple[float, ...] = GRID,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    backend: str = "auto",
    realize=None,
) -> SearchResult:
    """The α of `grid` whose scales minimise `group_error` on the rows `x` ``[T, K]``; ties go to
    the smaller α. `mean_x`: the calibration's mean |x| per channel (default: of `x`). No
    smoothing (all scales 1) is scored too: when no α beats it, the result's α is NaN and its
    scales are ones. `realize`: maps candidate scales to the ones the fold can store exactly
    (`realized_norm_scales`), which are then the ones scored and returned."""
    mean_x = x.float().abs().mean(0) if mean_x is None else mean_x
    return search_parts([Part(x, weights)], fmt, mean_x=mean_x, grid=grid, rounding=rounding, backend=backend, realize=realize)


def search_parts(
    parts: list[Part],
    fmt: str,
    *,
    mean_x: torch.Tensor,
    grid: tuple[float, ...] = GRID,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    backend: str = "auto",
    realize=None,
) -> SearchResult:
    """`search` for a fold whose consumers are several decision groups reading one input (each
    group on its own rows: an expert on the tokens routed to it): the objective is their summed
    errors over their summed references, the pooled NMSE; mean |w| is over every member's rows."""
    mean_w = mean_abs_weight(parts)
    refs = [p.x.float() @ torch.cat([w.float() for w in p.weights]).T for p in parts]

    def nmse(s: torch.Tensor) -> float:
        err = ref = 0.0
        for p, y in zip(parts, refs):
            e, r = group_error(p.x, p.weights, s, fmt, rounding, y_ref=y, backend=backend, amax=p.amax)
            err, ref = err + e, ref + r
        return err / ref if ref > 0 else float("inf")

    best_alpha, best_s = float("nan"), torch.ones_like(mean_w)
    best = unsmoothed = nmse(best_s)
    errors = {}
    for a in grid:
        s = candidate_scales(mean_x, mean_w, a)
        if realize is not None:
            s = realize(s)
        errors[a] = nmse(s)
        if errors[a] < best:
            best_alpha, best_s, best = a, s, errors[a]
    return SearchResult(best_alpha, best_s, errors, unsmoothed)
