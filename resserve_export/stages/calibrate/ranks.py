"""Data-parallel calibration under torchrun (`core.distributed.Ranks`): each rank runs either
pipeline on its share of the batches (and of the score samples); rank 0 merges the statistics in
global batch order and replays the score additions in rank order, so the result is what one
process computes."""

from __future__ import annotations

import shutil
from dataclasses import replace

import torch

from resserve_export.algorithms.scores import compute_scores, scores_record
from resserve_export.algorithms.scores.batches import take
from resserve_export.algorithms.scores.grad import ScoreSums
from resserve_export.core.distributed import Ranks, merge_kv, merge_stats
from resserve_export.core.errors import UserError
from resserve_export.core.outputs import temp_sibling
from resserve_export.core.ui import Progress
from resserve_export.formats.constants import RATIOS
from resserve_export.modeling import modelio
from resserve_export.observers.kv import KVCollector
from resserve_export.observers.stats import collect
from resserve_export.stages.calibrate import sequential
from resserve_export.stages.calibrate.by_layer import score_spec, sequential_groups
from resserve_export.stages.calibrate.collected import Collected
from resserve_export.stages.calibrate.config import CalibConfig
from resserve_export.stages.calibrate.linears import model_groups_of
from resserve_export.stages.calibrate.whole import smooth


def start_ranks(config: CalibConfig, resume: bool) -> tuple[Ranks, CalibConfig]:
    """Join torchrun's process group, refusing first what does not run there; returns the ranks
    and `config` with this rank's device."""
    if resume:
        raise UserError("--resume does not run under torchrun: run it in one process")
    if config.scores == "kl":
        raise UserError("--scores kl does not run under torchrun: use --scores grad, or one process")
    if "gptq" in config.weight_algo.split("+"):
        raise UserError(f"--weight-algo {config.weight_algo} does not run under torchrun yet: run it in one process; nothing was calibrated")
    ranks = Ranks.start(config.device)
    return ranks, replace(config, device=ranks.device(config.device))


def collect_ranks_sequential(ranks: Ranks, model_dir, out, config: CalibConfig, batches, show_progress) -> Collected:
    """One data-parallel rank of the sequential pipeline: the layer passes over its share of the
    batches (and of the score samples), the statistics merged on rank 0 in global batch order
    between the forward and the backward passes and sent back to every rank (the candidates
    need them), then every score addition replayed on rank 0 in rank order: what one process
    computes (the scores on rank 0 only)."""
    stage = [0]  # 0: before the merge; 1: in it (its agreement done); 2: after it

    def combine(col, kvc):
        stage[0] = 1
        ranks.agree(None)
        merged = merge_ranks(ranks, groups, col.parts(), kvc.result(), kvc.problem)
        stage[0] = 2
        return merged

    spec, log, spill, groups = score_spec(config), {"adds": [], "tokens": 0}, None, []
    try:
        groups, n_layers = sequential_groups(model_dir, config)
        mine = ranks.share(batches)
        if not mine:
            raise UserError(f"{len(batches)} batches for {ranks.size} ranks: use more --num-samples or fewer ranks")
        score_mine, samples = None, 0
        if spec is not None:
            every = take(batches, spec.samples, torch.device(config.device))
            samples = sum(int(b["input_ids"].shape[0]) for b in every)
            score_mine = ranks.share(every)
            if not score_mine:
                spec = None  # this rank adds nothing to the scores
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        spill = temp_sibling(out, "offload")
        passes = n_layers * (2 if spec is not None else 1)
        with Progress(f"calibrating layer by layer ({ranks.size} ranks)", passes, unit="layer passes", enabled=show_progress) as bar:

            def step(li: int, bi: int, n: int) -> None:
                if bi == n - 1:
                    bar.advance(1)

            r = sequential.collect_sequential(
                model_dir, config.device, config.dtype, mine, groups, spill, progress=step, scores=spec,
                score_batches=score_mine, combine=combine, score_log=log,
            )
            stats, num_tokens, kv_stats, kv_problem, local = r.stats, r.num_tokens, r.kv_stats, r.kv_problem, r.scores
    except BaseException as e:
        if stage[0] != 1:
            ranks.agree(e)  # raises: this rank's error here, a one-line one on the others
        raise
    finally:
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
    ranks.agree(None)
    scores = replay_scores(ranks, groups, log, local, samples, config) if config.scores == "grad" else None
    return Collected(stats, num_tokens, kv_stats, kv_problem, groups, scores)


def merge_ranks(ranks: Ranks, groups, parts: dict, kv_stats, kv_problem) -> tuple:
    """Every rank's statistics (`StatsCollector.parts()`) and KV statistics, merged on rank 0 in
    one-process order (`distributed.merge_stats` / `merge_kv`) and sent to every rank: (stats,
    num_tokens, kv statistics, why none), what `sequential.collect_sequential`'s ``combine``
    returns. A merge error is raised on every rank."""
    gathered = ranks.gather((parts, kv_stats, kv_problem))
    merged = None
    if ranks.rank == 0:
        try:
            every = [g[0] for g in gathered]
            merged = ("ok", merge_stats(every, groups), sum(p["tokens"] for p in every), merge_kv([g[1] for g in gathered]),
                      next((g[2] for g in gathered if g[2]), None))
        except UserError as e:
            merged = ("error", str(e))
    merged = ranks.broadcast(merged)
    if merged[0] == "error":
        raise UserError(merged[1])
    return merged[1:]


def replay_scores(ranks: Ranks, groups, log: dict, local: dict | None, samples: int, config: CalibConfig) -> dict | None:
    """The grad scores record of one process, on rank 0 (None elsewhere): every rank's score
    additions (`log`) replayed in rank order, over all ranks' loss tokens."""
    logs = ranks.gather({**log, "precision": local["precision"] if local else None, "seconds": local["wall_time_s"] if local else 0.0})
    if ranks.rank != 0:
        return None
    return scores_record(
        ScoreSums.replay(logs).normalised(groups, list(RATIOS), sum(x["tokens"] for x in logs)), groups, list(RATIOS), "grad",
        samples, config.format, config.mx_scale, next((x["precision"] for x in logs if x["precision"]), config.score_precision),
        max(x["seconds"] for x in logs),
    )


def collect_ranks(ranks: Ranks, model_dir, config: CalibConfig, batches, shapes, show_progress) -> Collected:
    """One data-parallel rank of the whole-model pipeline: statistics of its share of the
    batches, merged on rank 0 in global batch order and sent back to every rank; then grad
    scores of its share of the score samples, replayed on rank 0. Returns what
    `whole.collect_whole` returns (stats and scores as one process would compute them)."""
    err, net = None, None
    try:
        net = modelio.load_model_on(model_dir, config.device, config.dtype)
        groups = model_groups_of(net, model_dir)
        # Every rank searches the same rows (the first of all batches) and gets the same scales.
        smoothing, weight_algo = smooth(net, batches, groups, config, shapes, show_progress)
        mine = ranks.share(batches)
        with Progress(f"calibrating ({ranks.size} ranks)", len(mine), unit="batches", enabled=show_progress) as bar:
            kv = KVCollector(net)
            parts, _ = collect(net, mine, groups, lambda n, t: bar.advance(1), kv=kv, parts=True)
            kv_local = kv.result()
    except BaseException as e:
        err = e
    ranks.agree(err)
    stats, num_tokens, kv_stats, kv_problem = merge_ranks(ranks, groups, parts, kv_local, kv.problem)
    scores = None
    if config.scores == "grad":
        scores = _grad_scores_of_ranks(ranks, net, batches, stats, groups, config, show_progress)
    return Collected(stats, num_tokens, kv_stats, kv_problem, groups, scores, smoothing, weight_algo)


def _grad_scores_of_ranks(ranks: Ranks, net, batches, stats, groups, config: CalibConfig, show_progress) -> dict | None:
    """The whole-model grad scores: each rank's share of the score samples, replayed on rank 0."""
    err, log = None, {"adds": [], "tokens": 0}
    try:
        score_batches = take(batches, config.score_samples, torch.device(config.device))
        mine = ranks.share(score_batches)
        local = compute_scores(
            net, mine, stats, groups, "grad", list(RATIOS), config.format, None, rounding=config.mx_scale,
            show_progress=show_progress, precision=config.score_precision, log=log,
        ) if mine else None
    except BaseException as e:
        err = e
    ranks.agree(err)
    return replay_scores(ranks, groups, log, local, sum(int(b["input_ids"].shape[0]) for b in score_batches), config)
