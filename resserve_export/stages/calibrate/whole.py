"""The whole-model pipeline: load the model (accelerate offloading what does not fit), smooth it
with ``--weight-algo awq``, then collect the statistics and the scores in forward passes over
every batch."""

from __future__ import annotations

import shutil
from contextlib import nullcontext

from resserve_export.algorithms import gptq
from resserve_export.algorithms.awq.decoder import plan_folds
from resserve_export.algorithms.awq.pipeline import search_smoothing
from resserve_export.algorithms.awq.smoothing import Smoothing
from resserve_export.algorithms.scores import compute_scores
from resserve_export.core.outputs import temp_sibling
from resserve_export.core.ui import Progress, say
from resserve_export.formats.constants import RATIOS
from resserve_export.modeling import modelio
from resserve_export.modeling.experts import checkpoint_parameters, is_expert, unfused
from resserve_export.observers.experts import ExpertCollector
from resserve_export.observers.kv import KVCollector
from resserve_export.observers.stats import collect
from resserve_export.stages.calibrate.collected import Collected
from resserve_export.stages.calibrate.config import CalibConfig, note_slow_bf16
from resserve_export.stages.calibrate.linears import model_groups_of


def smooth(net, batches, groups, config: CalibConfig, shapes, show_progress, blocks=()) -> tuple[Smoothing | None, dict]:
    """With ``--weight-algo awq``: search the scales on `net` and smooth it in place, so that
    everything collected afterwards (salience, amax, KV statistics, expert statistics, scores)
    describes the smoothed model, with the values the checkpoint will store. `blocks`: a
    mixture-of-experts model's expert blocks. Returns (the `awq.Smoothing` or None,
    calibration.json's record)."""
    if "awq" not in config.weight_algo.split("+"):
        return None, {"name": "rtn"}
    blocks = list(blocks)
    with Progress("AWQ scale search", len(plan_folds(net, blocks, shapes)), unit="groups", enabled=show_progress) as bar:
        smoothing, record = search_smoothing(
            net, batches, groups, config.format, config.mx_scale, config.awq_tokens, progress=lambda: bar.advance(1),
            blocks=blocks, shapes=shapes, moe_calib=config.moe_calib,
        )
    # Experts as the slices of the fused parameters the collector computes with (checkpoint names).
    smoothing.apply_to_model(net, checkpoint_parameters(net, blocks))
    return smoothing, record


def collect_whole(model_dir, out, config: CalibConfig, batches, shapes, show_progress, on_batch, blocks=()) -> Collected:
    """The whole-model pipeline in one process. `blocks`: a mixture-of-experts model's expert
    blocks; `on_batch` is called with the number of batches done after each one."""
    offload = None
    if show_progress:
        note_slow_bf16(config)
    try:
        if config.device == "auto":
            out.absolute().parent.mkdir(parents=True, exist_ok=True)
            offload = temp_sibling(out, "offload")
        net = modelio.load_model_on(model_dir, config.device, config.dtype, offload_folder=offload)
        groups = model_groups_of(net, model_dir, blocks)
        smoothing, weight_algo = smooth(net, batches, groups, config, shapes, show_progress, blocks)

        total = sum(int(b["input_ids"].shape[0]) for b in batches)
        with Progress("calibrating", total, unit="samples", rate_unit="tok", enabled=show_progress) as bar:
            done = [0]

            def step(n_samples: int, n_tokens: int) -> None:
                bar.advance(n_samples, rate=n_tokens)
                done[0] += 1
                if on_batch is not None:
                    on_batch(done[0])

            kv = KVCollector(net)
            moe = None
            if blocks:
                dense = [g for g in groups if not is_expert(g.modules[0])]
                with ExpertCollector(net, list(blocks), config.moe_calib) as ec:
                    stats, num_tokens = collect(net, batches, dense, step, kv=kv, experts=ec)
                expert_stats, moe = ec.result()
                stats.update(expert_stats)
                warn_fallbacks(ec.fallbacks)
            else:
                stats, num_tokens = collect(net, batches, groups, step, kv=kv)
            kv_stats = kv.result()

        quantized = None
        if "gptq" in config.weight_algo.split("+"):
            quantized, weight_algo = run_gptq(net, batches, groups, config, weight_algo, show_progress, blocks)

        scores = None
        if config.scores != "none":
            # Experts scored as per-expert linears under their checkpoint names, with the true routing.
            with unfused(net, list(blocks)) if blocks else nullcontext():
                scores = compute_scores(
                    net, batches, stats, groups, config.scores, list(RATIOS), config.format, config.score_samples,
                    rounding=config.mx_scale, show_progress=show_progress, precision=config.score_precision, base_weights=quantized,
                )
    finally:
        if offload is not None:
            shutil.rmtree(offload, ignore_errors=True)
    return Collected(stats, num_tokens, kv_stats, kv.problem, groups, scores, smoothing, weight_algo, moe, quantized)


def run_gptq(net, batches, groups, config: CalibConfig, weight_algo: dict, show_progress, blocks=()) -> tuple[dict, dict]:
    """With ``--weight-algo gptq`` (or ``awq+gptq``, on the smoothed model): every quantized linear
    by GPTQ (`algorithms.gptq`). Returns ({module: FP4Tensor}, calibration.json's record, AWQ's
    fields kept)."""
    with Progress("GPTQ", len(groups), unit="groups", enabled=show_progress) as bar:
        quantized, record = gptq.quantize_model(
            net, batches, groups, config.format, config.mx_scale, blocks=list(blocks), progress=lambda: bar.advance(1),
            order=config.gptq_order,
        )
    if weight_algo.get("name", "rtn") != "rtn":
        record = {**weight_algo, **record, "name": config.weight_algo}
    fallback = record["rounded_to_nearest"]
    if fallback:
        more = f" and {len(fallback) - 5} more" if len(fallback) > 5 else ""
        say(f"warning: GPTQ rounded {len(fallback)} linears to nearest, no calibration token reached them ({', '.join(list(fallback)[:5])}{more})")
    return quantized, record


def warn_fallbacks(experts: list[str]) -> None:
    """Say which experts took their layer's pooled statistics (they saw no calibration token)."""
    if experts:
        more = f" and {len(experts) - 5} more" if len(experts) > 5 else ""
        say(
            f"warning: {len(experts)} experts saw no calibration token ({', '.join(experts[:5])}{more}): they take their "
            "layer's pooled expert statistics; calibrate with --moe-calib all or more samples for their own"
        )
