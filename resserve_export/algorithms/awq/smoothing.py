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

DeepSeek's multi-head latent attention (MLA) folds exactly everywhere: the input norm into
``q_a_proj`` (``q_proj`` without a query LoRA) and ``kv_a_proj_with_mqa`` together (two decision
groups reading one input: one ``s``, their errors summed), ``q_a_layernorm`` into ``q_b_proj``,
``kv_a_layernorm`` into ``kv_b_proj``, and ``o_proj`` into the value rows of ``kv_b_proj`` (every
head has its own value rows; its key rows stay as they are). Mixture-of-experts layers
(`awq_moe`): one ``s`` shared by every expert's gate/up, any shared expert's and the routers'
columns, folded into the norm; each expert's down_proj into its own up_proj rows.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from resserve_export.formats import registry
from resserve_export.core.errors import UserError
from resserve_export.formats.ops import qdq
from resserve_export.formats.mxfp4 import ScaleRounding

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
    from resserve_export.algorithms.awq import moe as awq_moe

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


def apply_fold(model, fold: Fold, s: torch.Tensor, params: dict | None = None) -> None:
    """Scale `model` in place by one fold: the producer's output divided by `s`, the consumers'
    (and readers') inputs multiplied by it (exact in real arithmetic); `Smoothing` with this fold
    alone. `params`: as for `Smoothing.apply_to_model`."""
    if fold.unscaled is not None:
        raise ValueError(f"{fold.consumers[0]} cannot be scaled: {fold.unscaled}")
    Smoothing([fold], {fold.consumers[0]: s}).apply_to_model(model, params)


# ----------------------------------------------------------------------------- the applied smoothing

WEIGHT_ALGOS = ("rtn", "awq")
FILE = "awq.safetensors"
SCALE_SUFFIX = "awq_scales"
OBJECTIVE = (
    "linear-output NMSE of the group under W4A4: FP4 weights with the fused group's tensor scale and FP4 "
    "activations with the static scale of the smoothed activations' amax"
)


MOE_OBJECTIVE = (
    "mixture-of-experts gate/up: one scale vector per layer shared by every expert, the shared experts and the routers; "
    "the summed error of every expert on the search tokens routed to it and of the shared experts on every search token, "
    "each expert with its own weight tensor scale and the activation scale of the amax --moe-calib records for it; "
    "each expert's down_proj on its routed search tokens (none: left unscaled)"
)


def check_weight_algo(name: str) -> str:
    if name not in WEIGHT_ALGOS:
        raise UserError(f"unknown --weight-algo {name!r}: choose one of {', '.join(WEIGHT_ALGOS)}")
    return name


def storage_dtypes(shapes: dict) -> dict[str, torch.dtype]:
    """``{tensor name: torch dtype}`` of every floating-point tensor of safetensors headers `shapes`."""
    from resserve_export.storage.checkpoint import DTYPES

    return {n: DTYPES[d][0] for n, (d, _) in shapes.items() if d in DTYPES and DTYPES[d][0].is_floating_point}


class Smoothing:
    """The scales of the smoothed groups and where they fold, as ordered tensor operations, under
    the checkpoint's tensor names.

    `apply(name, tensor)` is the one definition of a smoothed tensor: `calibrate` applies it to
    the loaded model's parameters, `pack` to the source tensors it streams and `verify` to the
    model's weights it checks against, so all three see the same values bit for bit. A tensor
    touched by two folds (``up_proj``: its columns for gate/up, its rows for down_proj) gets them
    in model order, columns first, each rounded to the tensor's dtype. `dtypes`: the dtype the
    checkpoint stores each tensor in; a model parameter loaded in another one (DeepSeek's router,
    float32 in the model, bf16 on disk) is smoothed from and rounded to the stored value
    (`stored`), then cast back.
    """

    def __init__(self, folds: list[Fold], scales: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype] | None = None):
        self.folds = [f for f in folds if f.unscaled is None and f.consumers[0] in scales]
        self.scales = {f.consumers[0]: scales[f.consumers[0]].float().contiguous() for f in self.folds}
        self.dtypes = dict(dtypes or {})
        self._by_consumer: dict[str, torch.Tensor] = {}
        self._rows: dict[str, torch.Tensor] = {}
        self._ops: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for f in self.folds:
            s = self.scales[f.consumers[0]]
            if f.kind.startswith("norm"):
                self._ops.setdefault(f"{f.producer}.weight", []).append((f.kind, s))
            else:
                r = self._rows[f.producer] = producer_row_scales(f, s)
                self._ops.setdefault(f"{f.producer}.weight", []).append(("rows", r))
                self._ops.setdefault(f"{f.producer}.bias", []).append(("bias", r))
            for c in (*f.consumers, *f.readers):
                self._ops.setdefault(f"{c}.weight", []).append(("cols", s))
            self._by_consumer.update({c: s for c in f.consumers})

    @property
    def tensors(self) -> list[str]:
        """Names of every tensor smoothing changes (biases included where a producer has one)."""
        return list(self._ops)

    def affects(self, name: str) -> bool:
        return name in self._ops

    def scale_for(self, consumers: tuple[str, ...] | list[str]) -> torch.Tensor | None:
        """The scales dividing the input of the decision group `consumers` (any group of a fold:
        an expert's gate/up shares its layer's)."""
        return self._by_consumer.get(consumers[0])

    def row_scale(self, module: str) -> torch.Tensor | None:
        """The scales dividing a linear's output rows (it produces a smoothed group's input), or
        None: its exact smoothed output is ``x Wᵀ / s``."""
        return self._rows.get(module)

    def apply(self, name: str, t: torch.Tensor) -> torch.Tensor:
        for op, s in self._ops.get(name, ()):
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

    def stored(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`name` smoothed as the checkpoint stores it: `t` in the stored dtype, then `apply`."""
        return self.apply(name, t.to(self.dtypes.get(name, t.dtype)))

    @torch.no_grad()
    def apply_to_model(self, model, params: dict | None = None) -> None:
        """Smooth `model`'s parameters in place (each affected parameter once, whatever its
        number of folds) to the values the checkpoint stores. `params`: ``{checkpoint name:
        tensor sharing the parameter's storage}`` (`experts.checkpoint_parameters` for a
        mixture-of-experts model), default the model's named parameters."""
        params = dict(model.named_parameters()) if params is None else params
        for name in self._ops:
            if name in params:
                p = params[name].detach()
                p.copy_(self.stored(name, p).to(p.dtype))

    @contextmanager
    def applied(self, model, params: dict | None = None):
        """`model` smoothed for the duration of the block, its parameters restored after."""
        params = dict(model.named_parameters()) if params is None else params
        saved = {n: params[n].detach().clone() for n in self._ops if n in params}
        try:
            self.apply_to_model(model, params)
            yield model
        finally:
            with torch.no_grad():
                for n, v in saved.items():
                    params[n].detach().copy_(v)

    def save(self, path) -> None:
        from safetensors.torch import save_file

        tensors = {f"{c}.{SCALE_SUFFIX}": s for c, s in self.scales.items()}
        save_file(tensors, str(path), metadata={"resserve_awq": "1"})

    @classmethod
    def from_calibration(cls, calib, record: dict, shapes: dict | None = None, dtypes: dict | None = None) -> Smoothing | None:
        """The smoothing a calibration directory recorded (None for ``rtn``), checked against
        the source's tensor headers `shapes` when given. `dtypes`: the stored dtype of each
        tensor (default: those of `shapes`)."""
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
            rows = g.get("rows")
            f = Fold(g["producer"], g["fold"], tuple(g["consumers"]), readers=tuple(g.get("readers") or ()), rows=tuple(rows) if rows else None)
            key = f"{f.consumers[0]}.{SCALE_SUFFIX}"
            if key not in stored:
                raise UserError(f"{path.name} has no scales for {f.consumers[0]}, which calibration.json lists: re-run calibrate")
            s = stored[key]
            if s.dtype != torch.float32 or s.dim() != 1 or not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
                raise UserError(f"{path.name}: the scales of {f.consumers[0]} are not positive finite float32 values: re-run calibrate")
            if f.rows is not None and (len(f.rows) != 2 or not 0 <= f.rows[1] < f.rows[0] or s.numel() % (f.rows[0] - f.rows[1])):
                raise UserError(f"{path.name}: the scales of {f.consumers[0]} do not fit the row layout calibration.json records: re-run calibrate")
            if shapes is not None:
                for c in (*f.consumers, *f.readers):
                    spec = shapes.get(f"{c}.weight")
                    if spec is None or tuple(spec[1])[-1] != s.numel():
                        raise UserError(
                            f"the AWQ scales of {f.consumers[0]} ({s.numel()} channels) do not fit {c} of this model: "
                            "pack the model the calibration was made from"
                        )
                spec = shapes.get(f"{f.producer}.weight")
                if spec is None:
                    raise UserError(f"this model has no {f.producer}.weight to fold the AWQ scales into: pack the model the calibration was made from")
                if f.kind == "rows" and tuple(spec[1])[0] != producer_row_scales(f, s).numel():
                    raise UserError(
                        f"the AWQ scales of {f.consumers[0]} do not fit the rows of {f.producer} of this model: pack the model the calibration was made from"
                    )
            folds.append(f)
            scales[f.consumers[0]] = s
        if dtypes is None and shapes is not None:
            dtypes = storage_dtypes(shapes)
        return cls(folds, scales, dtypes)


def file_digest(path) -> str:
    import hashlib

    return hashlib.sha256(open(path, "rb").read()).hexdigest()


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


def search_smoothing(
    model, batches: list[dict], groups, fmt: str, rounding: str, max_rows: int, progress=None, dtypes: dict | None = None,
    *, blocks=(), shapes: dict | None = None, moe_calib: str = "all",
) -> tuple[Smoothing, dict]:
    """Search every foldable group's scales on `model` (not changed here) and return the
    `Smoothing` with calibration.json's record of it. `dtypes`: the checkpoint dtype of each
    norm (``{module: torch dtype}``, default those of `shapes`, else the loaded one), in which
    `pack` will store the folded norm and so whose rounding the scales must account for
    (`realized_norm_scales`). `blocks`, `shapes`: a mixture-of-experts model's expert blocks and
    checkpoint headers (`awq_moe`); `moe_calib`: the calibration's ``--moe-calib``, which decides
    the amax an expert's activation scale comes from.

    The search rows are the first `max_rows` valid (non-padding) tokens of `batches` at each
    group's input (an expert: those of them routed to it), captured in one forward pass of the
    unsmoothed model: a fold changes only its own group's input (exactly, in real arithmetic), so
    no group's search depends on another's.
    """
    from resserve_export.algorithms.awq.moe import ExpertRows
    from resserve_export.stages.calibrate.run import forward_kwargs, input_device
    from resserve_export.modeling.experts import checkpoint_parameters, expert_parts
    from resserve_export.stages.verify.run import InputCapture

    if any(p.device.type == "meta" for p in model.parameters()):
        raise UserError("--weight-algo awq needs the whole model in memory, but it was offloaded to disk: pass --device cpu or a GPU that holds it")
    blocks = list(blocks)
    if dtypes is None and shapes is not None:
        dtypes = {n[: -len(".weight")]: d for n, d in storage_dtypes(shapes).items() if n.endswith(".weight")}
    folds = plan_folds(model, blocks, shapes)
    group_of = {m: tuple(g.modules) for g in groups for m in g.modules}
    params = checkpoint_parameters(model, blocks)
    records, search_folds = [], []
    for f in folds:
        rec = {"producer": f.producer, "fold": f.kind, "consumers": list(f.consumers), "alpha": None}
        if f.readers:
            rec["readers"] = list(f.readers)
        if f.rows is not None:
            rec["rows"] = list(f.rows)
        why = f.unscaled
        fg = fold_groups(f, group_of) if why is None else None
        if why is None and fg is None:
            why = "its consumers are not whole quantized groups"
        if why is None and f"{f.producer}.weight" not in params:
            why = f"{f.producer} has no weight to fold into"
        if why is not None:
            rec["unscaled"] = why
            if progress is not None:
                progress()
        else:
            search_folds.append((f, fg, rec))
        records.append(rec)
    mods = dict(model.named_modules())
    heads = list(dict.fromkeys(g for _, fg, _ in search_folds for g in fg if expert_parts(g[0]) is None))
    missing = [g[0] for g in heads if g[0] not in mods]
    if missing:
        raise UserError(f"linear {missing[0]} is not in the model: the weights and the architecture do not match")
    cap = InputCapture(model, heads, max_rows)
    rows = ExpertRows(model, blocks, max_rows) if blocks and any(expert_parts(c) for f, _, _ in search_folds for c in f.consumers) else None
    in_dev = input_device(model)
    kw = forward_kwargs(model)
    try:
        with torch.inference_mode():
            for b in batches:
                if all(cap.count[h] >= max_rows for h in heads) and (rows is None or rows.full()):
                    break
                cap.set_mask(b["attention_mask"])
                if rows is not None:
                    rows.set_mask(b["attention_mask"])
                model(input_ids=b["input_ids"].to(in_dev), attention_mask=b["attention_mask"].to(in_dev), **kw)
    finally:
        cap.remove()
        if rows is not None:
            rows.remove()
    last_use = {}  # block prefix -> the last fold searching its experts (its rows are freed after it)
    for i, (f, _, _) in enumerate(search_folds):
        for c in f.consumers:
            where = expert_parts(c)
            if where is not None:
                last_use[where[0]] = i
    scales = {}
    for i, (f, fg, rec) in enumerate(search_folds):
        dev = params[f"{f.consumers[0]}.weight"].device
        parts, mean_x, tokens, unreached = [], None, None, []
        for g in fg:
            w = [params[f"{m}.weight"] for m in g]
            where = expert_parts(g[0])
            if where is None:
                x = cap.inputs(g).to(dev)
                parts.append(Part(x, w))
                if mean_x is None:
                    mean_x, tokens = x.float().abs().mean(0), x.shape[0]
                continue
            part = rows.part(g, w, moe_calib)
            if part is None:
                unreached.append(g[0])
                continue
            parts.append(Part(part.x.to(dev), w, None if part.amax is None else part.amax.to(dev)))
            if mean_x is None:
                # an expert's gate/up: the mean over every search token of the layer (the input all share)
                every = rows.tokens(where[0])[0] if where[2] == "gate/up" else part.x
                mean_x, tokens = every.to(dev).float().abs().mean(0), every.shape[0]
        for g in fg:
            cap.rows.pop(g, None)
        for prefix, last in last_use.items():
            if last == i:
                rows.release(prefix)
        if not parts:
            rec["unscaled"] = "no search token was routed to this expert"
            if progress is not None:
                progress()
            continue
        realize = None
        if f.kind.startswith("norm"):
            nw = params[f"{f.producer}.weight"]
            nw = nw.to(dtypes.get(f.producer, nw.dtype)) if dtypes else nw
            realize = functools.partial(realized_norm_scales, nw, one_plus=f.kind == "norm_one_plus")
        r = search_parts(parts, fmt, mean_x=mean_x, rounding=rounding, realize=realize)
        rec["tokens"] = int(tokens)
        if unreached:
            rec["experts_without_search_tokens"] = unreached
        rec["nmse_unsmoothed"] = r.unsmoothed
        if math.isnan(r.alpha):
            rec["unscaled"] = "no α of the grid lowers the group's error"
        else:
            rec["alpha"] = r.alpha
            rec["nmse"] = r.errors[r.alpha]
            scales[f.consumers[0]] = r.scales.cpu()
        if progress is not None:
            progress()
    smoothing = Smoothing(folds, scales, storage_dtypes(shapes) if shapes is not None else None)
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
    if blocks:
        record["moe"] = MOE_OBJECTIVE
    return smoothing, record


__all__ = [
    "GRID", "SearchResult", "Part", "candidate_scales", "group_error", "search", "search_parts", "mean_abs_weight", "fold_into_norm",
    "fold_into_rows", "scale_columns", "o_proj_foldable", "Fold", "producer_row_scales", "plan_folds", "fold_groups", "apply_fold",
    "WEIGHT_ALGOS", "FILE", "Smoothing", "storage_dtypes", "search_smoothing", "check_weight_algo", "file_digest",
]
