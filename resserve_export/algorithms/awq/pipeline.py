"""The AWQ search over a whole model: capture each group's search rows, search every fold in
model order on the unsmoothed inputs, and return the `Smoothing` that calibrate records."""

from __future__ import annotations

import functools
import math

import torch

from resserve_export.algorithms.awq.decoder import plan_folds
from resserve_export.algorithms.awq.fold import Fold, fold_groups, realized_norm_scales
from resserve_export.algorithms.awq.moe import ExpertRows
from resserve_export.algorithms.awq.search import GRID, Part, search_parts
from resserve_export.algorithms.awq.smoothing import FILE, Smoothing, storage_dtypes
from resserve_export.core.errors import UserError
from resserve_export.formats import registry
from resserve_export.modeling.experts import checkpoint_parameters, expert_parts
from resserve_export.modeling.forward import forward_kwargs, input_device
from resserve_export.observers.capture import InputCapture

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


def search_smoothing(
    model, batches: list[dict], groups, fmt: str, rounding: str, max_rows: int, progress=None, dtypes: dict | None = None,
    *, blocks=(), shapes: dict | None = None, moe_calib: str = "all",
) -> tuple[Smoothing, dict]:
    """Search every foldable group's scales on `model` (not changed here) and return the
    `Smoothing` with calibration.json's record of it. `dtypes`: the checkpoint dtype of each
    norm (``{module: torch dtype}``, default those of `shapes`, else the loaded one), in which
    `pack` will store the folded norm and so whose rounding the scales must account for
    (`realized_norm_scales`). `blocks`, `shapes`: a mixture-of-experts model's expert blocks and
    checkpoint headers (`awq.moe`); `moe_calib`: the calibration's ``--moe-calib``, which decides
    the amax an expert's activation scale comes from. `progress()` is called once per fold.

    The search rows are the first `max_rows` valid (non-padding) tokens of `batches` at each
    group's input (an expert: those of them routed to it), captured in one forward pass of the
    unsmoothed model: a fold changes only its own group's input (exactly, in real arithmetic), so
    no group's search depends on another's.
    """
    if any(p.device.type == "meta" for p in model.parameters()):
        raise UserError("--weight-algo awq needs the whole model in memory, but it was offloaded to disk: pass --device cpu or a GPU that holds it")
    blocks = list(blocks)
    if dtypes is None and shapes is not None:
        dtypes = {n[: -len(".weight")]: d for n, d in storage_dtypes(shapes).items() if n.endswith(".weight")}
    folds = plan_folds(model, blocks, shapes)
    params = checkpoint_parameters(model, blocks)
    records, searches = _searches(folds, groups, params, progress)
    cap, rows = _capture(model, batches, searches, blocks, max_rows)
    last_use = {}  # block prefix -> the last search of its experts (its rows are freed after it)
    for i, (f, _, _) in enumerate(searches):
        for c in f.consumers:
            where = expert_parts(c)
            if where is not None:
                last_use[where[0]] = i
    scales = {}
    for i, (f, fg, rec) in enumerate(searches):
        dev = params[f"{f.consumers[0]}.weight"].device
        parts, mean_x, tokens, unreached = _parts(fg, params, cap, rows, moe_calib, dev)
        for prefix, last in last_use.items():
            if last == i:
                rows.release(prefix)
        if parts:
            s = _search_fold(f, parts, mean_x, tokens, unreached, rec, params, fmt, rounding, dtypes)
            if s is not None:
                scales[f.consumers[0]] = s
        else:
            rec["unscaled"] = "no search token was routed to this expert"
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


def _searches(folds: list[Fold], groups, params: dict, progress) -> tuple[list[dict], list[tuple[Fold, list, dict]]]:
    """calibration.json's record of every fold, and the folds to search: (fold, its consumers'
    groups, its record). A fold that cannot be scaled is recorded with why (and counted done)."""
    group_of = {m: tuple(g.modules) for g in groups for m in g.modules}
    records, searches = [], []
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
            searches.append((f, fg, rec))
        records.append(rec)
    return records, searches


def _capture(model, batches: list[dict], searches, blocks: list, max_rows: int) -> tuple[InputCapture, ExpertRows | None]:
    """The search rows of every searched group, in one forward pass of the unsmoothed model over
    `batches` until every group has `max_rows`: the inputs of the dense groups (`InputCapture`),
    and with `blocks` the rows routed to each expert (`ExpertRows`)."""
    mods = dict(model.named_modules())
    heads = list(dict.fromkeys(g for _, fg, _ in searches for g in fg if expert_parts(g[0]) is None))
    missing = [g[0] for g in heads if g[0] not in mods]
    if missing:
        raise UserError(f"linear {missing[0]} is not in the model: the weights and the architecture do not match")
    cap = InputCapture(model, heads, max_rows)
    rows = ExpertRows(model, blocks, max_rows) if blocks and any(expert_parts(c) for f, _, _ in searches for c in f.consumers) else None
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
    return cap, rows


def _parts(
    fg, params: dict, cap: InputCapture, rows: ExpertRows | None, moe_calib: str, dev,
) -> tuple[list[Part], torch.Tensor | None, int | None, list[str]]:
    """The search `Part` of each group of a fold on `dev` (the captured rows are dropped), the
    mean |x| of the fold's input and its token count, and the experts no search token reached."""
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
    return parts, mean_x, tokens, unreached


def _search_fold(f: Fold, parts, mean_x, tokens, unreached, rec: dict, params: dict, fmt, rounding, dtypes) -> torch.Tensor | None:
    """Search one fold's α on its `parts`, filling its record `rec`; its scales (on the CPU), or
    None when no α of the grid lowers the group's error."""
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
        return None
    rec["alpha"] = r.alpha
    rec["nmse"] = r.errors[r.alpha]
    return r.scales.cpu()
