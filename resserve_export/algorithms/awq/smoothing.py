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

import hashlib
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from resserve_export.algorithms.awq.fold import (
    Fold,
    fold_into_norm,
    fold_into_rows,
    producer_row_scales,
    scale_columns,
)
from resserve_export.core.errors import UserError
from resserve_export.storage.safetensors import ST_DTYPES

# ----------------------------------------------------------------------------- exact folds


def apply_fold(model, fold: Fold, s: torch.Tensor, params: dict | None = None) -> None:
    """Scale `model` in place by one fold: the producer's output divided by `s`, the consumers'
    (and readers') inputs multiplied by it (exact in real arithmetic); `Smoothing` with this fold
    alone. `params`: as for `Smoothing.apply_to_model`."""
    if fold.unscaled is not None:
        raise ValueError(f"{fold.consumers[0]} cannot be scaled: {fold.unscaled}")
    Smoothing([fold], {fold.consumers[0]: s}).apply_to_model(model, params)


# ----------------------------------------------------------------------------- the applied smoothing

WEIGHT_ALGOS = ("rtn", "awq", "gptq", "awq+gptq")
FILE = "awq.safetensors"
SCALE_SUFFIX = "awq_scales"


def check_weight_algo(name: str) -> str:
    if name not in WEIGHT_ALGOS:
        raise UserError(f"unknown --weight-algo {name!r}: choose one of {', '.join(WEIGHT_ALGOS)}")
    return name


def storage_dtypes(shapes: dict) -> dict[str, torch.dtype]:
    """``{tensor name: torch dtype}`` of every floating-point tensor of safetensors headers `shapes`."""

    return {n: ST_DTYPES[d][0] for n, (d, _) in shapes.items() if d in ST_DTYPES and ST_DTYPES[d][0].is_floating_point}


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

        tensors = {f"{c}.{SCALE_SUFFIX}": s for c, s in self.scales.items()}
        save_file(tensors, str(path), metadata={"resserve_awq": "1"})

    @classmethod
    def from_calibration(cls, calib, record: dict, shapes: dict | None = None, dtypes: dict | None = None) -> Smoothing | None:
        """The smoothing a calibration directory recorded (None for ``rtn``), checked against
        the source's tensor headers `shapes` when given. `dtypes`: the stored dtype of each
        tensor (default: those of `shapes`)."""

        algo = record.get("weight_algo") or {"name": "rtn"}
        if algo.get("name", "rtn") in ("rtn", "gptq"):
            return None
        if algo.get("name") not in ("awq", "awq+gptq"):
            raise UserError(f"{calib} records weight algorithm {algo.get('name')!r}, which this version does not know: re-run calibrate")
        path = Path(calib) / (algo.get("file") or FILE)
        if not path.is_file():
            raise UserError(f"{calib} records AWQ smoothing but has no {path.name}: re-run calibrate")

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
    """SHA-256 of a file, read in 1 MiB chunks (a GPTQ file is about a quarter of the model)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


__all__ = [
    "GRID", "SearchResult", "Part", "candidate_scales", "group_error", "search", "search_parts", "mean_abs_weight", "fold_into_norm",
    "fold_into_rows", "scale_columns", "o_proj_foldable", "Fold", "producer_row_scales", "plan_folds", "fold_groups", "apply_fold",
    "WEIGHT_ALGOS", "FILE", "Smoothing", "storage_dtypes", "search_smoothing", "check_weight_algo", "file_digest",
]
