"""Activation-aware weight scaling (AWQ) for W4A4: the scale search and the exact folds.

`calibrate --weight-algo awq` searches the scales (`search_smoothing`), applies them to the loaded
model before it collects salience, amax and scores (so they describe the smoothed activations the
runtime sees) and stores them (`Smoothing.save`, ``awq.safetensors``); `pack` applies the same
`Smoothing` to the source tensors it streams; `verify` reproduces it from the calibration.

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

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import registry
from .errors import UserError
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
    x: torch.Tensor,
    weights: list[torch.Tensor],
    s: torch.Tensor,
    fmt: str,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    *,
    y_ref: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[float, float]:
    """(Σ‖Y_q − Y‖², Σ‖Y‖²) of a group under W4A4 with scales `s`: Y = x Wᵀ in FP32 of the
    original operands (the members' outputs side by side; `y_ref` when already computed);
    Y_q = Q_a(x / s) Q_w(W · s)ᵀ, where Q_w uses the fused group's one tensor scale and Q_a the
    static activation scale of amax(x / s) (what `pack` derives from a calibration of the smoothed
    activations). `backend`: the quantizer's (`formats.quantize`; every backend is bit-exact)."""
    f = registry.get(fmt)
    s = s.to(x.device)
    xs = x.float() / s
    ws = [w.float() * s for w in weights]
    alpha_w = f.weight_alpha(ws)
    alpha_x = f.input_alpha(xs.abs().amax())
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
    mean_w = torch.cat([w.float().abs() for w in weights], dim=0).mean(0)
    y_ref = x.float() @ torch.cat([w.float() for w in weights]).T
    best_alpha, best_s, best = float("nan"), torch.ones_like(mean_w), None
    e, r = group_error(x, weights, best_s, fmt, rounding, y_ref=y_ref, backend=backend)
    best = unsmoothed = e / r if r > 0 else float("inf")
    errors = {}
    for a in grid:
        s = candidate_scales(mean_x, mean_w, a)
        if realize is not None:
            s = realize(s)
        e, r = group_error(x, weights, s, fmt, rounding, y_ref=y_ref, backend=backend)
        errors[a] = e / r if r > 0 else float("inf")
        if errors[a] < best:
            best_alpha, best_s, best = a, s, errors[a]
    return SearchResult(best_alpha, best_s, errors, unsmoothed)


# ----------------------------------------------------------------------------- exact folds


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


def apply_fold(model, fold: Fold, s: torch.Tensor) -> None:
    """Scale `model` in place by one fold: the producer's output divided by `s`, the consumers'
    inputs multiplied by it (exact in real arithmetic); `Smoothing` with this fold alone."""
    if fold.unscaled is not None:
        raise ValueError(f"{fold.consumers[0]} cannot be scaled: {fold.unscaled}")
    Smoothing([fold], {fold.consumers[0]: s}).apply_to_model(model)


# ----------------------------------------------------------------------------- the applied smoothing

WEIGHT_ALGOS = ("rtn", "awq")
FILE = "awq.safetensors"
SCALE_SUFFIX = "awq_scales"
OBJECTIVE = (
    "linear-output NMSE of the group under W4A4: FP4 weights with the fused group's tensor scale and FP4 "
    "activations with the static scale of the smoothed activations' amax"
)


def check_weight_algo(name: str) -> str:
    if name not in WEIGHT_ALGOS:
        raise UserError(f"unknown --weight-algo {name!r}: choose one of {', '.join(WEIGHT_ALGOS)}")
    return name


class Smoothing:
    """The scales of the smoothed groups and where they fold, as ordered tensor operations.

    `apply(name, tensor)` is the one definition of a smoothed tensor: `calibrate` applies it to
    the loaded model's parameters, `pack` to the source tensors it streams and `verify` to the
    model's weights it checks against, so all three see the same values bit for bit. A tensor
    touched by two folds (``up_proj``: its columns for gate/up, its rows for down_proj) gets them
    in model order, columns first, each rounded to the tensor's dtype.
    """

    def __init__(self, folds: list[Fold], scales: dict[str, torch.Tensor]):
        self.folds = [f for f in folds if f.unscaled is None and f.consumers[0] in scales]
        self.scales = {f.consumers[0]: scales[f.consumers[0]].float().contiguous() for f in self.folds}
        self._ops: dict[str, list[tuple[str, Fold, torch.Tensor]]] = {}
        for f in self.folds:
            s = self.scales[f.consumers[0]]
            if f.kind.startswith("norm"):
                self._ops.setdefault(f"{f.producer}.weight", []).append((f.kind, f, s))
            else:
                self._ops.setdefault(f"{f.producer}.weight", []).append(("rows", f, s))
                self._ops.setdefault(f"{f.producer}.bias", []).append(("bias", f, s))
            for c in f.consumers:
                self._ops.setdefault(f"{c}.weight", []).append(("cols", f, s))

    @property
    def tensors(self) -> list[str]:
        """Names of every tensor smoothing changes (biases included where a producer has one)."""
        return list(self._ops)

    def affects(self, name: str) -> bool:
        return name in self._ops

    def scale_for(self, consumers: tuple[str, ...] | list[str]) -> torch.Tensor | None:
        """The scales dividing the input of the group whose first member is ``consumers[0]``."""
        return self.scales.get(consumers[0])

    def row_scale(self, module: str) -> torch.Tensor | None:
        """The scales dividing a linear's output rows (it produces a smoothed group's input), or
        None: its exact smoothed output is ``x Wᵀ / s``."""
        for f in self.folds:
            if f.kind == "rows" and f.producer == module:
                return self.scales[f.consumers[0]]
        return None

    def apply(self, name: str, t: torch.Tensor) -> torch.Tensor:
        for op, _, s in self._ops.get(name, ()):
            s = s.to(t.device)
            if op.startswith("norm"):
                t = fold_into_norm(t, s, one_plus=op == "norm_one_plus")
            elif op == "rows":
                t = fold_into_rows(t, s)[0]
            elif op == "bias":
                t = (t.float() / s).to(t.dtype)
            else:
                t = scale_columns(t, s)
        return t

    @torch.no_grad()
    def apply_to_model(self, model) -> None:
        """Smooth `model`'s parameters in place (each affected parameter once, whatever its
        number of folds)."""
        params = dict(model.named_parameters())
        for name in self._ops:
            if name in params:
                p = params[name]
                p.copy_(self.apply(name, p.detach()))

    @contextmanager
    def applied(self, model):
        """`model` smoothed for the duration of the block, its parameters restored after."""
        params = dict(model.named_parameters())
        saved = {n: params[n].detach().clone() for n in self._ops if n in params}
        try:
            self.apply_to_model(model)
            yield model
        finally:
            with torch.no_grad():
                for n, v in saved.items():
                    params[n].copy_(v)

    def save(self, path) -> None:
        from safetensors.torch import save_file

        tensors = {f"{c}.{SCALE_SUFFIX}": s for c, s in self.scales.items()}
        save_file(tensors, str(path), metadata={"resserve_awq": "1"})

    @classmethod
    def from_calibration(cls, calib, record: dict, shapes: dict | None = None) -> Smoothing | None:
        """The smoothing a calibration directory recorded (None for ``rtn``), checked against
        the source's tensor headers `shapes` when given."""
        from pathlib import Path

        algo = record.get("weight_algo") or {"name": "rtn"}
        if algo.get("name", "rtn") == "rtn":
            return None
        if algo.get("name") != "awq":
            raise UserError(f"{calib} records weight algorithm {algo.get('name')!r}, which this version does not know: re-run calibrate")
        path = Path(calib) / (algo.get("file") or FILE)
        if not path.is_file():
            raise UserError(f"{calib} records AWQ smoothing but has no {path.name}: re-run calibrate")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            stored = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path} is not a readable safetensors file ({e}): re-run calibrate") from None
        folds, scales = [], {}
        for g in algo.get("groups", []):
            if g.get("alpha") is None:
                continue
            f = Fold(g["producer"], g["fold"], tuple(g["consumers"]))
            key = f"{f.consumers[0]}.{SCALE_SUFFIX}"
            if key not in stored:
                raise UserError(f"{path.name} has no scales for {f.consumers[0]}, which calibration.json lists: re-run calibrate")
            s = stored[key]
            if s.dtype != torch.float32 or s.dim() != 1 or not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
                raise UserError(f"{path.name}: the scales of {f.consumers[0]} are not positive finite float32 values: re-run calibrate")
            if shapes is not None:
                for c in f.consumers:
                    spec = shapes.get(f"{c}.weight")
                    if spec is None or tuple(spec[1])[-1] != s.numel():
                        raise UserError(
                            f"the AWQ scales of {f.consumers[0]} ({s.numel()} channels) do not fit {c} of this model: "
                            "pack the model the calibration was made from"
                        )
                if f"{f.producer}.weight" not in shapes:
                    raise UserError(f"this model has no {f.producer}.weight to fold the AWQ scales into: pack the model the calibration was made from")
            folds.append(f)
            scales[f.consumers[0]] = s
        return cls(folds, scales)


def file_digest(path) -> str:
    import hashlib

    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def search_smoothing(
    model, batches: list[dict], groups, fmt: str, rounding: str, max_rows: int, progress=None, dtypes: dict | None = None
) -> tuple[Smoothing, dict]:
    """Search every foldable group's scales on `model` (not changed here) and return the
    `Smoothing` with calibration.json's record of it. `dtypes`: the checkpoint dtype of each
    norm (``{module: torch dtype}``, default the loaded one), in which `pack` will store the
    folded norm and so whose rounding the scales must account for (`realized_norm_scales`).

    The search rows are the first `max_rows` valid (non-padding) tokens of `batches` at each
    group's input, captured in one forward pass of the unsmoothed model: a fold changes only its
    own group's input (exactly, in real arithmetic), so no group's search depends on another's.
    """
    from .calibrate import forward_kwargs, input_device
    from .verify import InputCapture

    folds = plan_folds(model)
    quantized = {frozenset(g.modules) for g in groups}
    mods = dict(model.named_modules())
    if any(p.device.type == "meta" for p in model.parameters()):
        raise UserError("--weight-algo awq needs the whole model in memory, but it was offloaded to disk: pass --device cpu or a GPU that holds it")
    records, search_folds = [], []
    for f in folds:
        rec = {"producer": f.producer, "fold": f.kind, "consumers": list(f.consumers), "alpha": None}
        why = f.unscaled
        if why is None and frozenset(f.consumers) not in quantized:
            why = "its consumers are not one quantized group"
        if why is None and (f.producer not in mods or not hasattr(mods[f.producer], "weight")):
            why = f"{f.producer} has no weight to fold into"
        if why is not None:
            rec["unscaled"] = why
            if progress is not None:
                progress()
        else:
            search_folds.append((f, rec))
        records.append(rec)
    heads = [f.consumers for f, _ in search_folds]
    cap = InputCapture(model, heads, max_rows)
    dev = input_device(model)
    kw = forward_kwargs(model)
    try:
        with torch.inference_mode():
            for b in batches:
                if all(cap.count[h] >= max_rows for h in heads):
                    break
                cap.set_mask(b["attention_mask"])
                model(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev), **kw)
    finally:
        cap.remove()
    scales = {}
    for f, rec in search_folds:
        w = [mods[c].weight.detach() for c in f.consumers]
        x = cap.inputs(f.consumers).to(w[0].device)
        cap.rows[f.consumers] = []
        realize = None
        if f.kind.startswith("norm"):
            nw = mods[f.producer].weight.detach()
            nw = nw.to(dtypes.get(f.producer, nw.dtype)) if dtypes else nw
            realize = functools.partial(realized_norm_scales, nw, one_plus=f.kind == "norm_one_plus")
        r = search(x, w, fmt, rounding=rounding, realize=realize)
        rec["tokens"] = int(x.shape[0])
        rec["nmse_unsmoothed"] = r.unsmoothed
        if math.isnan(r.alpha):
            rec["unscaled"] = "no α of the grid lowers the group's error"
        else:
            rec["alpha"] = r.alpha
            rec["nmse"] = r.errors[r.alpha]
            scales[f.consumers[0]] = r.scales.cpu()
        if progress is not None:
            progress()
    smoothing = Smoothing(folds, scales)
    record = {
        "name": "awq",
        "file": FILE,
        "grid": list(GRID),
        "objective": OBJECTIVE,
        "search_tokens": max_rows,
        "format": fmt,
        "mx_scale_rounding": str(getattr(rounding, "value", rounding)) if registry.get(fmt).has_rounding else None,
        "smoothed_groups": len(smoothing.folds),
        "groups": records,
    }
    return smoothing, record


__all__ = [
    "GRID", "SearchResult", "candidate_scales", "group_error", "search", "fold_into_norm", "fold_into_rows",
    "scale_columns", "o_proj_foldable", "Fold", "plan_folds", "apply_fold", "WEIGHT_ALGOS", "FILE", "Smoothing",
    "search_smoothing", "check_weight_algo", "file_digest",
]
