"""Sensitivity scores for the ratio planner (docs/formats.md, "Ratio planner"): s(l, ρ) = damage when only group l is
quantized (weights and activations FP4, calibrated α, residue compensation at ratio ρ on the
channels `selection.select_mask(mean_abs, ρ)` picks) and the rest of the model is unquantized.

Two methods, both through the one emulated FP4 linear of `resserve_export.emulate`:

- ``kl`` (`kl`): mean over valid tokens of KL(p_ref ‖ p_q) between next-token distributions,
  one forward per (group, ρ), rerunning only from the group's layer where the model allows.
- ``grad`` (`grad`): Σ over valid tokens of Σ_j (∂L/∂Y ⊙ (Y_q − Y))² per group (Fisher-diagonal,
  as in BRECQ) from one forward + backward per batch, every candidate ratio scored in the
  backward hooks. The candidate products run in FP32 (the emulated linear's own arithmetic) or,
  by default for bf16 models on GPUs and on CPUs with fast bf16 GEMMs, as bf16 GEMMs on the same
  FP4 operands, exact in bf16 (`Candidates.prepare_fast`).

Padding never counts: KL is averaged over positions with attention_mask = 1, and the loss of the
grad method ignores padded targets (so their ∂L/∂Y is zero).

One concept per module:

- `candidates`: a group's quantized candidates (`Candidates`: FP32 and bf16 products, installing
  a group or a plan in the model) and `build_candidates`;
- `bf16`: the bf16 GEMM layouts (fused / split), their reductions and the operand backends
  (compiled graph, fused CUDA kernel, eager reference);
- `pool`: the memory-budgeted `CandidatePool` and `default_budget`;
- `precision`: ``fp32`` / ``bf16`` / ``auto`` (`resolve_precision`) and the bytes per weight of
  each layout;
- `device`: what the device's GEMMs can do (``/proc/cpuinfo`` bf16 features, FP32-output GEMMs);
- `kl`, `grad`: the two methods (`kl` also has `evaluate_kl(s)`, a whole plan's KL);
- `loss`, `norm`, `mlp`: the grad scores' next-token loss, and its passes' RMSNorms and gated-MLP
  activations, each with a fused Triton pair (forward, backward) for CUDA;
- `worker`: the grad scores' own host thread (`ScoringThread`, opt-in), which launches the
  candidate products while the backward pass goes on;
- `batches`: the scored sequences on the model's device and the mask of tokens that count;
- `progress`: the terminal progress display;
- this module: `compute_scores`, the entry point ``calibrate --scores`` calls, and the public names.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Iterable

import torch
from torch import nn

from resserve_export.formats.constants import RATIOS
from resserve_export.modeling.groups import Group
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.algorithms.selection import check_ratio
from resserve_export.algorithms.scores.batches import device_of, take
from resserve_export.algorithms.scores.bf16 import split_base
from resserve_export.algorithms.scores.candidates import Candidates, build_candidates, quantized

from resserve_export.algorithms.scores.grad import grad_scores
from resserve_export.algorithms.scores.kl import kl_scores, evaluate_kl, evaluate_kls
from resserve_export.algorithms.scores.pool import CandidatePool, default_budget
from resserve_export.algorithms.scores.precision import PRECISIONS, bytes_per_weight_of, resolve_precision
from resserve_export.algorithms.scores.progress import scoring_progress
from resserve_export.algorithms.scores.worker import wanted
from resserve_export.core.names import ratio_key

METHODS = ("kl", "grad")
DEFAULT_RATIOS = RATIOS


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
    memory_budget: int | None = None,
    precision: str = "auto",
    log: dict | None = None,
    base_weights: dict | None = None,
) -> dict:
    """The content of ``scores.json`` (see the module docstring and the calibration contract).

    stats: ``{module: {"mean_abs": float32 [K], "amax": float32 0-d}}`` for every group member.
    batches: ``{"input_ids", "attention_mask"}`` dicts (moved to the embedding's device here).
    num_samples: score on the first `num_samples` sequences of `batches` only (None: all).
    progress: called as ``progress(done, total)`` in (batch, group, ratio) units; without it a
    rich progress bar is shown when `show_progress`.
    candidates: prebuilt `build_candidates(...)` for these groups and ratios (reused across calls);
    without it a memory-bounded `CandidatePool` keeps the groups that fit `memory_budget` bytes
    (default: `default_budget`, half the free memory) and rebuilds the others per batch.
    precision: arithmetic of the grad method's candidate products: ``fp32`` (the emulated linear's
    own FP32 products, bit for bit, minus the module's output), ``bf16`` (the exact FP4 operands
    in bf16 GEMMs with FP32 accumulation, see `Candidates.prepare_fast`: within ~2e-4 of a float64
    oracle on SmolLM2, where the fp32 path's bf16 reference output puts it within ~1e-2) or
    ``auto`` (bf16 on CUDA GPUs and on CPUs with AVX512-BF16/AMX for bf16 models, and on GPUs
    for fp16 models where a bf16/fp16 GEMM can write FP32; else fp32: see `resolve_precision`).
    The bf16 path keeps bf16 copies of the candidate weights (≈ 4 bytes per weight on such GPUs,
    ≈ 8 elsewhere). The result records the precision used. KL scores always use the FP32 path.
    log: grad only: record every addition and the token count (a data-parallel rank's share).
    base_weights: ``{module: FP4Tensor}``, the base quantization of those linears (GPTQ's) in
    place of round to nearest; their extensions are built from its dequantized weights.
    """
    if method not in METHODS:
        raise ValueError(f"unknown score method {method!r}, available: {list(METHODS)}")
    ratios = sorted({check_ratio(r) for r in ratios})
    rounding = ScaleRounding(rounding)
    dtypes = {model.get_submodule(m).weight.dtype for g in groups for m in g.modules}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    precision = resolve_precision(precision, device_of(model), dtype)
    missing = [m for g in groups for m in g.modules if m not in stats]
    if missing:
        raise ValueError(f"no calibration stats for {missing[0]} ({len(missing)} modules)")
    batches = take(batches, num_samples, device_of(model))
    num_samples = sum(int(b["input_ids"].shape[0]) for b in batches)
    if num_samples == 0:
        raise ValueError("no samples to score")
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    total = len(batches) * len(groups) * len(ratios)
    done = [0]
    pool = None

    with scoring_progress(progress, show_progress, method, len(groups), len(ratios), num_samples) as (wprog, progress):

        def step(n: int = 1) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

        try:
            if candidates is None:
                budget = default_budget(device_of(model)) if memory_budget is None else int(memory_budget)
                bpw = bytes_per_weight_of(method, precision, device_of(model), dtype)
                pool = candidates = CandidatePool(model, groups, stats, ratios, fmt, rounding, budget, bpw, base_weights)
                # The grad hooks visit the groups last layer first: keep those that fit from there,
                # built ahead on a thread of their own where `build_ahead_wanted`, in the first
                # forward pass where `build_in_forward_wanted` (CUDA), else before the first
                # batch, or, with a scoring thread, there on first use (`worker`).
                order = [g.modules for g in (reversed(groups) if method == "grad" else groups)]
                if method == "grad" and build_ahead_wanted(device_of(model)):
                    pool.build_ahead(order, wprog, _operands(precision, dtype, device_of(model)))
                elif method == "grad" and not wanted() and build_in_forward_wanted(device_of(model)):
                    pool.build_in_forward(order, wprog, _operands(precision, dtype, device_of(model)))
                elif not (method == "grad" and wanted()):
                    pool.prebuild(order, wprog)
            if method == "kl":
                sums = kl_scores(model, batches, groups, candidates, ratios, step)
            else:
                sums = grad_scores(model, batches, groups, candidates, ratios, step, precision, log=log)
            if pool is not None:
                pool.close()
        finally:
            if pool is not None:
                pool.close(raise_error=False)
            model.train(was_training)
    return scores_record(sums, groups, ratios, method, num_samples, fmt, rounding, precision, time.perf_counter() - t0)


def build_ahead_wanted(device: torch.device) -> bool:
    """Whether the grad scores build their candidates ahead, on a thread of their own
    (`CandidatePool.build_ahead`): meant for GPUs, where building is host work that the model's
    passes leave room for. Opt-in (``RESSERVE_BUILD_AHEAD=1``, on any device): slower on an
    H100 (`pool`'s docstring)."""
    return os.environ.get("RESSERVE_BUILD_AHEAD", "") == "1"


def build_in_forward_wanted(device: torch.device) -> bool:
    """Whether the grad scores build each group's candidates in the first forward pass, as the
    group's first member runs (`CandidatePool.build_in_forward`), instead of all of them before
    it: on CUDA, where the build is host work that can run while the GPU works through the
    forward launched before it (``RESSERVE_BUILD_IN_FORWARD=0`` builds them first)."""
    return device.type == "cuda" and os.environ.get("RESSERVE_BUILD_IN_FORWARD", "") != "0"


def _operands(precision: str, dtype: torch.dtype, device: torch.device):
    """What the build-ahead thread makes after each group: the bf16 path's weight operands in the
    layout the scoring will ask for (`bf16.split_base` of the model's dtype), else nothing."""
    if precision != "bf16":
        return None
    x = torch.empty((1, 1), dtype=dtype, device=device)
    return lambda cand: cand.build_fast_weights(split_base(x, cand.linears))


def scores_record(sums: dict, groups: list[Group], ratios, method: str, num_samples: int, fmt: str, rounding, precision: str, seconds: float) -> dict:
    """``scores.json``'s content from per-group ``{ratio: score}`` sums."""
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
        "ratios": list(ratios),
        "format": fmt,
        "rounding": ScaleRounding(rounding).value,
        **({"precision": precision} if method == "grad" else {}),
        "wall_time_s": round(seconds, 3),
        "groups": out_groups,
    }


def _finite(v: float, g: Group) -> float:
    if not math.isfinite(v):
        raise ValueError(f"score of {g.name} is not finite ({v}): check the calibration stats and the model dtype")
    return float(v)


__all__ = ["METHODS", "PRECISIONS", "DEFAULT_RATIOS", "CandidatePool", "Candidates", "default_budget", "build_candidates", "compute_scores", "evaluate_kl", "evaluate_kls", "quantized", "ratio_key", "resolve_precision"]
