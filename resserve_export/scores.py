"""Sensitivity scores for the ratio planner (SPEC §10): s(l, ρ) = damage when only group l is
quantized (weights and activations FP4, calibrated α, residue compensation at ratio ρ on the
channels `selection.select_mask(mean_abs, ρ)` picks) and the rest of the model is unquantized.

Two methods, both through the one emulated FP4 linear of `resserve_export.emulate`:

- ``kl``: mean over valid tokens of KL(p_ref ‖ p_q) between next-token distributions, one forward
  per (group, ρ). The model runs once per batch to capture the hidden state entering every decoder
  layer; a (group, ρ) then reruns only from the group's layer to the logits. If the model's logits
  are not `lm_head(norm(h))` of its last layer (checked on the first batch), every (group, ρ) runs
  the whole model instead.
- ``grad``: Σ over valid tokens of Σ_j (∂L/∂Y ⊙ (Y_q − Y))² per group (Fisher-diagonal, as in
  BRECQ), L the summed next-token cross-entropy. One forward + backward per batch; backward hooks
  on each quantized linear's output receive ∂L/∂Y and score every candidate ratio of the group
  right there from the captured input (all candidates from one pass). Weight gradients are never
  computed. Reported per valid token.

Padding never counts: KL is averaged over positions with attention_mask = 1, and the loss of the
grad method ignores padded targets (so their ∂L/∂Y is zero).
"""

from __future__ import annotations

import math
import time
import copy
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterable

import torch
from torch import nn

from .constants import RATIOS
from .emulate import QuantizedWeight, quantized_matmul, residue_operand, residue_weight
from .formats import dequantize, quantize
from .kext import extend_weight, residue
from .groups import Group
from .mxfp4 import ScaleRounding
from .nvfp4 import global_scale
from .selection import check_ratio, mode_of, select_mask

METHODS = ("kl", "grad")
DEFAULT_RATIOS = RATIOS


def ratio_key(ratio: float) -> str:
    return f"{float(ratio):g}"


# ---------------------------------------------------------------------------------------------
# Quantized candidates of one group


class Candidates:
    """Emulated FP4 weights of one group's members for each candidate ratio.

    Fused members share the group's weight α (max amax over the members, SPEC §3) and the input α
    from the calibrated amax. The base quantization is computed once per member and shared by
    every ratio (plain and full use it alone; partial ratios add their K-Ext extension), exactly
    as `QuantizedWeight` builds it (tests check the two bit for bit).
    """

    def __init__(self, model: nn.Module, group: Group, stats: dict, ratios, fmt: str, rounding: ScaleRounding):
        self.group, self.fmt, self.rounding = group, fmt, ScaleRounding(rounding)
        self.ratios = sorted({check_ratio(r) for r in ratios})
        self.linears = [model.get_submodule(m) for m in group.modules]
        st = stats[group.modules[0]]
        mean_abs = torch.as_tensor(st["mean_abs"], dtype=torch.float32)
        amax = torch.as_tensor(st["amax"], dtype=torch.float32)
        self.input_alpha = global_scale(amax) if fmt == "nvfp4" else None
        weight_alpha = None
        if fmt == "nvfp4":
            weight_alpha = global_scale(torch.stack([lin.weight.detach().abs().amax().float() for lin in self.linears]).amax())
        self.masks = {r: select_mask(mean_abs, r) for r in self.ratios}
        base = [
            QuantizedWeight(lin.weight.detach(), fmt, ratio=0.0, weight_alpha=weight_alpha, rounding=self.rounding)
            for lin in self.linears
        ]
        # qw[r][i]: member i at ratio r.
        self.qw: dict[float, list[QuantizedWeight]] = {}
        for r in self.ratios:
            if mode_of(r) == "k_ext":
                self.qw[r] = [_extended(b, lin.weight.detach(), r, self.masks[r]) for b, lin in zip(base, self.linears)]
            else:
                self.qw[r] = base
        self.backend = "auto"
        self.biases = [None if lin.bias is None else lin.bias.detach().float() for lin in self.linears]

    def outputs(self, x: torch.Tensor, r: float, i: int) -> torch.Tensor:
        """Emulated FP4 output of member i at ratio r for x ``[M, K]`` (FP32, bias added)."""
        y = quantized_matmul(x, self.qw[r][i], input_alpha=self.input_alpha, mode=mode_of(r))
        return y if self.biases[i] is None else y + self.biases[i]

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[float, torch.Tensor]]:
        """Per-input work shared by every member and ratio: X̂ (dequantized) and, per compensated
        ratio, the quantized-dequantized residue (all of it for full, the compacted selection for
        partial ratios).

        Large inputs go through the compiled quantizer (`formats.quantize(backend="auto")`, bit-identical
        to the reference that `quantized_matmul` calls; ``RESSERVE_BACKEND=reference`` forces it)."""
        xq = quantize(x, self.fmt, alpha=self.input_alpha, rounding=self.rounding, backend=self.backend)
        xd = dequantize(xq)
        res = residue(x, xq)
        extra: dict[float, torch.Tensor] = {}
        for r in self.ratios:
            mode = mode_of(r)
            if mode != "plain":
                width = residue_weight(self.qw[r][0], mode).shape[-1]
                extra[r] = residue_operand(
                    res, xq, mode, mask=self.masks[r], width=width, rounding=self.rounding, backend=self.backend
                )
        return xd, extra

    def member_outputs(self, prepared, i: int):
        """Yield ``(ratio, output)`` of member i for every candidate ratio, bit for bit equal to
        `outputs`: the operations of `emulate.quantized_matmul` in the same order, with X̂Ŵᵀ
        computed once for all ratios."""
        xd, extra = prepared
        w = self.qw[self.ratios[0]][i].w
        base = xd @ w.T
        for r in self.ratios:
            mode = mode_of(r)
            y = base if mode == "plain" else base + extra[r] @ residue_weight(self.qw[r][i], mode).T
            yield r, (y if self.biases[i] is None else y + self.biases[i])

    @contextmanager
    def installed(self, model: nn.Module, r: float):
        """Swap the group's linears for their emulated FP4 version at ratio r (restored on exit)."""
        cand = self
        swaps = []

        class _Emulated(nn.Module):
            def __init__(self, i: int, lin: nn.Linear):
                super().__init__()
                self.i, self.out_features = i, lin.out_features

            def forward(self, x):
                shape = x.shape
                y = cand.outputs(x.reshape(-1, shape[-1]), r, self.i)
                return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

        for i, (name, lin) in enumerate(zip(self.group.modules, self.linears)):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            swaps.append((parent, leaf, lin))
            setattr(parent, leaf, _Emulated(i, lin))
        try:
            yield
        finally:
            for parent, leaf, lin in swaps:
                setattr(parent, leaf, lin)


def _extended(base: QuantizedWeight, weight: torch.Tensor, ratio: float, mask: torch.Tensor) -> QuantizedWeight:
    """`base` plus the K-Ext extension for a partial ratio: what ``QuantizedWeight(weight, ...,
    ratio=ratio, mask=mask)`` builds, without quantizing the base again."""
    q = copy.copy(base)
    q.ratio, q.mask = ratio, mask
    q.ext = extend_weight(weight, mask, ratio, base.fmt, base.rounding, alpha=base.base.global_scale)
    q.w_ext = dequantize(q.ext)
    return q


def build_candidates(
    model: nn.Module, groups: list[Group], stats: dict, ratios=DEFAULT_RATIOS, fmt: str = "nvfp4", rounding="ceil", progress=None
) -> dict[tuple[str, ...], Candidates]:
    """{group modules: Candidates}: every group's quantized weights, built once (the costly part)."""
    out = {}
    for k, g in enumerate(groups):
        out[g.modules] = Candidates(model, g, stats, ratios, fmt, ScaleRounding(rounding))
        if progress is not None:
            progress(k + 1, len(groups))
    return out


@contextmanager
def quantized(model: nn.Module, cands: dict, ratios: dict[tuple[str, ...], float]):
    """Install several groups at their ratios at once (e.g. a whole plan) and restore on exit."""
    with ExitStack() as stack:
        for key, r in ratios.items():
            stack.enter_context(cands[key].installed(model, r))
        yield


# ---------------------------------------------------------------------------------------------
# Model structure for the KL fast path


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList, nn.Module, nn.Module] | None:
    """(prefix, layers, final norm, lm_head) of a standard decoder-only causal LM, else None."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(layers, nn.ModuleList) or norm is None or head is None:
        return None
    prefix = next((n for n, m in model.named_modules() if m is layers), None)
    if prefix is None:
        return None
    return prefix, layers, norm, head


def _layer_of(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _valid(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    return (mask if mask is not None else torch.ones_like(ids)).bool()


def _kl_sum(ref_logp: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> float:
    """Σ over valid positions of KL(p_ref ‖ p_q); ref_logp is already restricted to valid rows."""
    logq = torch.log_softmax(logits[valid].float(), dim=-1)
    return float(torch.sum(ref_logp.exp() * (ref_logp - logq)))


def _kl_scores(model, batches, groups, cands, ratios, step) -> dict:
    structure = _decoder_layers(model)
    sums = {g.modules: {r: 0.0 for r in ratios} for g in groups}
    tokens = 0
    for batch in batches:
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        valid = _valid(mask, ids)
        tokens += int(valid.sum())
        captured: dict[int, tuple[torch.Tensor, dict]] = {}
        final: list[torch.Tensor] = []
        hooks = []
        fast = structure is not None
        if fast:
            prefix, layers, norm, head = structure
            for j, layer in enumerate(layers):

                def pre(mod, args, kwargs, j=j):
                    h = args[0] if args else kwargs["hidden_states"]
                    kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                    captured[j] = (h.detach(), kw, args[1:])

                hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(norm.register_forward_pre_hook(lambda mod, args: final.append(args[0].detach())))
        try:
            with torch.no_grad():
                ref_logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        finally:
            for h in hooks:
                h.remove()
        ref_logp = torch.log_softmax(ref_logits[valid].float(), dim=-1)
        if fast:
            with torch.no_grad():
                again = head(norm(final[-1]))
            fast = len(final) == 1 and torch.allclose(again.float(), ref_logits.float(), rtol=1e-3, atol=1e-3)
        del ref_logits

        def tail(start: int):
            h = captured[start][0]
            for j in range(start, len(layers)):
                # Each layer gets the arguments it was called with (masks may differ per layer type).
                _, kw, extra = captured[j]
                h = _first(layers[j](h, *extra, **kw))
            return head(norm(h))

        for g in groups:
            layer = _layer_of(g.modules[0], prefix) if fast else None
            for r in ratios:
                with torch.no_grad(), cands[g.modules].installed(model, r):
                    if layer is not None:
                        logits = tail(layer)
                    else:
                        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                sums[g.modules][r] += _kl_sum(ref_logp, logits, valid)
                del logits
                step()
    return {k: {r: s / max(tokens, 1) for r, s in v.items()} for k, v in sums.items()}


# ---------------------------------------------------------------------------------------------
# Gradient-weighted output error


def _grad_scores(model, batches, groups, cands, ratios, step) -> dict:
    sums = {g.modules: {r: 0.0 for r in ratios} for g in groups}
    tokens = 0
    params = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in params:
        p.requires_grad_(False)
    embed = model.get_input_embeddings()
    try:
        for batch in batches:
            ids, mask = batch["input_ids"], batch.get("attention_mask")
            valid = _valid(mask, ids)
            # Next-token targets: position t predicts t+1 when both are valid tokens.
            target_ok = valid[:, 1:] & valid[:, :-1]
            tokens += int(target_ok.sum())
            hooks = []

            for g in groups:
                cand = cands[g.modules]
                # Fused members read the same input: prepare it once, at the first member's gradient.
                shared = {"prepared": None, "left": 0}
                for i, lin in enumerate(cand.linears):

                    def fwd(mod, args, out, cand=cand, i=i, key=g.modules, shared=shared):
                        if not out.requires_grad:
                            return
                        x = args[0].detach()
                        y = out.detach()
                        shared["left"] += 1

                        def on_grad(grad):
                            x2 = x.reshape(-1, x.shape[-1])
                            if shared["prepared"] is None:
                                shared["prepared"] = cand.prepare(x2)
                            y2 = y.reshape(-1, y.shape[-1]).float()
                            g2 = grad.reshape(-1, grad.shape[-1]).float()
                            for r, yq in cand.member_outputs(shared["prepared"], i):
                                d = (yq - y2) * g2
                                sums[key][r] += float(torch.sum(d * d))
                            shared["left"] -= 1
                            if shared["left"] == 0:
                                shared["prepared"] = None

                        out.register_hook(on_grad)

                    hooks.append(lin.register_forward_hook(fwd))
            try:
                emb = embed(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=emb, attention_mask=mask, use_cache=False).logits
                lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                nll = -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
                loss = torch.sum(nll[target_ok])
                loss.backward()
            finally:
                for h in hooks:
                    h.remove()
            del logits, lp, nll, loss, emb
            step(len(groups) * len(ratios))
    finally:
        for p, flag in params:
            p.requires_grad_(flag)
    return {k: {r: s / max(tokens, 1) for r, s in v.items()} for k, v in sums.items()}


# ---------------------------------------------------------------------------------------------


def compute_scores(
    model: nn.Module,
    batches: list[dict],
    stats: dict,
    groups: list[Group],
    method: str,
    ratios: Iterable[float] = DEFAULT_RATIOS,
    fmt: str = "nvfp4",
    num_samples: int | None = None,
    rounding: ScaleRounding | str = "ceil",
    progress: Callable[[int, int], None] | None = None,
    show_progress: bool = True,
    candidates: dict | None = None,
) -> dict:
    """The content of ``scores.json`` (see the module docstring and the calibration contract).

    stats: ``{module: {"mean_abs": float32 [K], "amax": float32 0-d}}`` for every group member.
    batches: ``{"input_ids", "attention_mask"}`` dicts (moved to the embedding's device here).
    num_samples: score on the first `num_samples` sequences of `batches` only (None: all).
    progress: called as ``progress(done, total)`` in (batch, group, ratio) units; without it a
    rich progress bar is shown when `show_progress`.
    candidates: prebuilt `build_candidates(...)` for these groups and ratios (reused across calls).
    """
    if method not in METHODS:
        raise ValueError(f"unknown score method {method!r}, available: {list(METHODS)}")
    ratios = sorted({check_ratio(r) for r in ratios})
    rounding = ScaleRounding(rounding)
    missing = [m for g in groups for m in g.modules if m not in stats]
    if missing:
        raise ValueError(f"no calibration stats for {missing[0]} ({len(missing)} modules)")
    batches = _take(batches, num_samples, _device_of(model))
    num_samples = sum(int(b["input_ids"].shape[0]) for b in batches)
    if num_samples == 0:
        raise ValueError("no samples to score")
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    total = len(batches) * len(groups) * len(ratios)
    done = [0]

    def step(n: int = 1) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    bar = None
    if progress is None and show_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        wtask = bar.add_task(f"quantizing weights ({len(groups)} groups × {len(ratios)} ratios)", total=len(groups))
        task = bar.add_task(f"scoring ({method}, {num_samples} samples, batch × group × ratio)", total=total)
        progress = lambda d, t: bar.update(task, completed=d)  # noqa: E731
        bar.start()
    try:
        if candidates is None:
            wprog = (lambda d, t: bar.update(wtask, completed=d)) if bar is not None else None
            candidates = build_candidates(model, groups, stats, ratios, fmt, rounding, progress=wprog)
        elif bar is not None:
            bar.update(wtask, completed=len(groups))
        if method == "kl":
            sums = _kl_scores(model, batches, groups, candidates, ratios, step)
        else:
            sums = _grad_scores(model, batches, groups, candidates, ratios, step)
    finally:
        model.train(was_training)
        if bar is not None:
            bar.stop()
    out_groups = []
    for g in groups:
        s = sums[g.modules]
        out_groups.append(
            {
                "modules": list(g.modules),
                "weight_count": g.weight_count,
                "scores": {ratio_key(r): _finite(s[r], g) for r in ratios},
            }
        )
    return {
        "method": method,
        "samples": int(num_samples),
        "tokens_normalised": True,
        "ratios": ratios,
        "format": fmt,
        "rounding": rounding.value,
        "wall_time_s": round(time.perf_counter() - t0, 3),
        "groups": out_groups,
    }


def evaluate_kl(model: nn.Module, batches: list[dict], candidates: dict, ratios: dict[tuple[str, ...], float]) -> float:
    """Mean KL(p_ref ‖ p_q) per valid token when every group in `ratios` is quantized at its ratio
    at once (e.g. a whole plan): the end-to-end check a plan is judged by."""
    return evaluate_kls(model, batches, candidates, [ratios])[0]


def evaluate_kls(model: nn.Module, batches: list[dict], candidates: dict, plans: list[dict[tuple[str, ...], float]]) -> list[float]:
    """`evaluate_kl` for several plans, sharing the unquantized reference pass."""
    batches = _take(batches, None, _device_of(model))
    totals, tokens = [0.0] * len(plans), 0
    with torch.no_grad():
        for b in batches:
            ids, mask = b["input_ids"], b.get("attention_mask")
            valid = _valid(mask, ids)
            ref = torch.log_softmax(model(input_ids=ids, attention_mask=mask, use_cache=False).logits[valid].float(), dim=-1)
            for k, ratios in enumerate(plans):
                with quantized(model, candidates, ratios):
                    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                totals[k] += _kl_sum(ref, logits, valid)
                del logits
            tokens += int(valid.sum())
    return [t / max(tokens, 1) for t in totals]


def _device_of(model: nn.Module) -> torch.device:
    emb = model.get_input_embeddings()
    dev = emb.weight.device if emb is not None else next(model.parameters()).device
    return torch.device("cpu") if dev.type == "meta" else dev


def _take(batches: list[dict], n: int | None, device: torch.device) -> list[dict]:
    """The first n sequences of `batches` (all when n is None), on `device`."""
    out, left = [], n
    for b in batches:
        if left is not None and left <= 0:
            break
        rows = b["input_ids"].shape[0] if left is None else min(left, b["input_ids"].shape[0])
        nb = {k: v[:rows].to(device) for k, v in b.items() if k in ("input_ids", "attention_mask")}
        if "attention_mask" in nb:
            # Drop columns that are padding in every kept row.
            width = int(nb["attention_mask"].sum(dim=1).max())
            if int(nb["attention_mask"][:, width:].sum()) == 0:  # right padding
                nb = {k: v[:, :width] for k, v in nb.items()}
        out.append(nb)
        if left is not None:
            left -= rows
    return out


def _finite(v: float, g: Group) -> float:
    if not math.isfinite(v):
        raise ValueError(f"score of {g.name} is not finite ({v}): check the calibration stats and the model dtype")
    return float(v)


__all__ = ["METHODS", "DEFAULT_RATIOS", "Candidates", "build_candidates", "compute_scores", "evaluate_kl", "evaluate_kls", "quantized", "ratio_key"]
