"""Calibration: activation salience (mean |x| per input channel) and amax of every quantized linear.

Forward pre-hooks sit on the first member of each decision group (SPEC §5: q/k/v and gate/up read
one input, so one record serves the group). Per batch a hook takes |x| of the valid (non-padding)
tokens once, reduces it over tokens in float32 (float64 for a float64 model) and adds the result to
a float64 accumulator (SPEC §9: never accumulated in the model dtype); amax is kept as a running
maximum. Non-finite activations are caught once per batch and reported with the first layer, in
forward order, that saw them.

Output (the calibration dir, written atomically by :func:`write_dir_atomic`):
``salience.safetensors`` (``<module>.mean_abs`` float32 ``[in_features]``, ``<module>.amax`` float32
0-d, for every quantized linear), ``calibration.json`` (provenance; the only run-dependent field is
``wall_time_s``), and with ``--scores`` a ``scores.json`` from :mod:`resserve_export.scores`.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from resserve_export.core.errors import UserError
from resserve_export.core.names import natural_key
from resserve_export.core.outputs import check_out_dir, clean_stale, temp_sibling, write_dir_atomic
from resserve_export.core.ui import Progress
from resserve_export.formats.constants import MXFP4_BLOCK, RATIOS
from resserve_export.formats.registry import FORMATS
from resserve_export.modeling.groups import Group, expert_modules, group_linears, is_quantized
from resserve_export.observers.stats import collect
from resserve_export.storage.calibration import save_stats, versions

# The presets: the repository's calib_configs/, installed as the package data of
# resserve_export.calib_configs (pyproject's package-dir), so bare names work from a wheel too.
CONFIG_DIR = importlib.resources.files("resserve_export.calib_configs")
SCORE_METHODS = ("none", "grad", "kl")
DTYPES = ("bfloat16", "float16", "float32", "float64")
# Every quantized input dimension must hold whole MXFP4 blocks (32), which also covers NVFP4 (16).
IN_FEATURES_MULTIPLE = MXFP4_BLOCK


@dataclass
class CalibConfig:
    """Calibration settings. Defaults are the published protocol (SPEC §9), as in paper.yaml."""

    dataset: str = "shakespeare"
    num_samples: int = 1024
    seq_len: int = 2048
    batch_size: int = 8
    seed: int = 42
    device: str = "auto"
    dtype: str = "bfloat16"
    scores: str = "grad"
    score_samples: int = 32
    score_precision: str = "auto"
    format: str = "nvfp4"
    mx_scale: str = "ceil"
    weight_algo: str = "rtn"
    awq_tokens: int = 2048
    pipeline: str = "auto"
    moe_calib: str = "all"

    def validate(self) -> CalibConfig:
        for name in ("num_samples", "seq_len", "batch_size", "score_samples", "awq_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UserError(f"--seed must be a non-negative integer, got {self.seed!r}")
        if self.scores not in SCORE_METHODS:
            raise UserError(f"--scores must be one of {', '.join(SCORE_METHODS)}, got {self.scores!r}")
        if self.format not in FORMATS:
            raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        from resserve_export.formats.mxfp4 import ScaleRounding

        roundings = [r.value for r in ScaleRounding]
        if self.mx_scale not in roundings:
            raise UserError(f"--mx-scale must be one of {', '.join(roundings)}, got {self.mx_scale!r}")
        from resserve_export.algorithms.scores import PRECISIONS as SCORE_PRECISIONS

        if self.score_precision not in SCORE_PRECISIONS:
            raise UserError(f"--score-precision must be one of {', '.join(SCORE_PRECISIONS)}, got {self.score_precision!r}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        from resserve_export.algorithms.awq.smoothing import check_weight_algo
        from resserve_export.stages.calibrate.sequential import PIPELINES

        check_weight_algo(self.weight_algo)
        if self.pipeline not in PIPELINES:
            raise UserError(f"--pipeline must be one of {', '.join(PIPELINES)}, got {self.pipeline!r}")
        from resserve_export.modeling.experts import MOE_CALIB

        if self.moe_calib not in MOE_CALIB:
            raise UserError(f"--moe-calib must be one of {', '.join(MOE_CALIB)}, got {self.moe_calib!r}")
        return self


@dataclass(frozen=True)
class CalibrationResult:
    """A written calibration directory; `record` is its calibration.json."""

    path: Path
    model: str
    fingerprint: str
    groups: list[tuple[str, ...]]
    num_samples: int
    num_tokens: int
    scores: str  # grad | kl | none (scores.json exists unless none)
    wall_time_s: float
    record: dict


def preset_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in CONFIG_DIR.iterdir() if p.name.endswith(".yaml") and p.is_file())


def load_preset(name_or_path: str) -> dict:
    """Settings from a preset: a YAML path, or a bare name of a packaged preset (``calib_configs/NAME.yaml``)."""
    import yaml

    path = Path(name_or_path).expanduser()
    if not path.is_file():
        for cand in (CONFIG_DIR / f"{name_or_path}.yaml", Path.cwd() / "calib_configs" / f"{name_or_path}.yaml"):
            if cand.is_file():
                path = cand
                break
        else:
            raise UserError(f"unknown calibration config {name_or_path!r}, available names: [{', '.join(preset_names())}] or a YAML path")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a mapping of settings, e.g. 'num_samples: 32'")
    known = {f.name for f in fields(CalibConfig)}
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"{path}: unknown setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    return data


def make_config(preset: str | None = None, **overrides) -> CalibConfig:
    """Preset values, then every override that is not None (flags override the preset)."""
    values = load_preset(preset) if preset else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return CalibConfig(**values).validate()


def check_in_features(linears: dict[str, tuple[int, int]]) -> None:
    """Every quantized linear needs in_features divisible by 32 (whole FP4 blocks and selection groups)."""
    for name in sorted(linears, key=natural_key):
        k = linears[name][1]
        if is_quantized(name) and k % IN_FEATURES_MULTIPLE:
            raise UserError(
                f"linear {name} has in_features {k}, not a multiple of {IN_FEATURES_MULTIPLE}: "
                "FP4 blocks cannot tile it; this model is not supported"
            )


def calibrate(
    model: str,
    out: Path,
    config: CalibConfig,
    overwrite: bool = False,
    show_progress: bool = True,
    on_batch: Callable[[int], None] | None = None,
    resume: bool = False,
) -> CalibrationResult:
    """The whole command: resolve the model, sample the data, collect statistics, write ``out``
    atomically. `resume`: continue an interrupted layer-by-layer run of the same ``out``."""
    from resserve_export.modeling import data, modelio
    from resserve_export.observers import kv as kvcache
    from resserve_export.storage import kv_stats as kv_file

    t0 = time.perf_counter()
    config.validate()
    out = Path(out)
    check_out_dir(out, overwrite)
    clean_stale(out)
    modelio.parse_device(config.device)
    model_dir = modelio.resolve_model(model)
    modelio.check_architecture(model_dir, "calibrate")
    shapes = modelio.tensor_shapes(model_dir)
    from resserve_export.core.distributed import world_size
    from resserve_export.modeling.experts import expert_blocks

    blocks = expert_blocks(shapes, "calibrated")
    if blocks:
        _check_moe_settings(config, world_size())
    check_in_features(_quantized_linears(shapes))
    fingerprint = modelio.fingerprint(model_dir)
    docs = data.load_documents(config.dataset)
    tokenizer = modelio.load_tokenizer(model_dir)
    samples = data.make_samples(tokenizer, docs, config.num_samples, config.seq_len, config.seed)
    batches = data.batches(samples, config.batch_size, data.pad_id(tokenizer))

    ranks = None
    if world_size() > 1:
        if resume:
            raise UserError("--resume does not run under torchrun: run it in one process")
        if config.scores == "kl":
            raise UserError("--scores kl does not run under torchrun: use --scores grad, or one process")
        from dataclasses import replace

        from resserve_export.core.distributed import Ranks

        ranks = Ranks.start(config.device)
        config = replace(config, device=ranks.device(config.device))
    pipeline = "whole" if blocks else choose_pipeline(config, shapes)
    if ranks is not None:
        pipeline = ranks.broadcast(pipeline)  # auto: rank 0's choice (free memory differs by device)
    if resume and pipeline != "sequential":
        raise UserError("--resume continues a layer-by-layer run: pass --pipeline sequential with the interrupted run's settings")
    samples_sha256, versions_ = data.samples_digest(samples), versions()
    # The sequential pipeline does not smooth (AWQ needs the whole model).
    smoothing, weight_algo, moe = None, {"name": "rtn"}, None
    if ranks is not None and pipeline == "sequential":
        got = _collect_ranks_sequential(ranks, model_dir, out, config, batches, show_progress and ranks.rank == 0)
        stats, num_tokens, kv_stats, kv_problem, groups, scores = got
    elif ranks is not None:
        got = _collect_ranks(ranks, model_dir, config, batches, shapes, show_progress and ranks.rank == 0)
        stats, num_tokens, kv_stats, kv_problem, groups, smoothing, weight_algo, scores = got
    elif pipeline == "sequential":
        key = {"fingerprint": fingerprint, "samples_sha256": samples_sha256, "versions": versions_}
        key.update({k: v for k, v in asdict(config).items() if k != "pipeline"})
        stats, num_tokens, kv_stats, kv_problem, groups, scores = _collect_sequential(
            model_dir, out, config, batches, show_progress, on_batch, key, resume
        )
    else:
        stats, num_tokens, kv_stats, kv_problem, groups, smoothing, weight_algo, scores, moe = _collect_whole(
            model_dir, out, config, batches, shapes, show_progress, on_batch, blocks
        )
    if scores is not None:
        scores["fingerprint"] = fingerprint

    record = {
        "model": modelio.model_label(model),
        "model_dir": str(model_dir),
        "fingerprint": fingerprint,
        "fingerprint_method": modelio.FINGERPRINT_METHOD,
        "dataset": config.dataset,
        "num_samples": len(samples),
        "num_tokens": num_tokens,
        "seq_len": config.seq_len,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "samples_sha256": samples_sha256,
        "dtype": config.dtype,
        "device": config.device,
        "scores": config.scores,
        "versions": versions_,
        "groups": [list(g.modules) for g in groups],
        "pipeline": pipeline,
        "weight_algo": weight_algo,
        "kv_cache": (
            {"file": kv_file.FILE, "point": kvcache.POINT, "layers": len(kv_stats)}
            if kv_stats is not None
            else {"file": None, "why_not": kv_problem}
        ),
        "config": asdict(config),
    }
    if moe is not None:
        record["moe"] = moe

    def write(tmp: Path) -> None:
        save_stats(stats, tmp / "salience.safetensors")
        if smoothing is not None:
            smoothing.save(tmp / weight_algo["file"])
        if kv_stats is not None:
            kv_file.save(kv_stats, tmp / kv_file.FILE)
        if scores is not None:
            (tmp / "scores.json").write_text(json.dumps(scores, indent=2) + "\n")
        record["wall_time_s"] = round(time.perf_counter() - t0, 3)
        (tmp / "calibration.json").write_text(json.dumps(record, indent=2) + "\n")

    if ranks is None:
        path = write_dir_atomic(out, write, overwrite)
    else:
        record["data_parallel"] = {"ranks": ranks.size, "backend": ranks.backend}
        err = None
        if ranks.rank == 0:
            try:
                path = write_dir_atomic(out, write, overwrite)
            except BaseException as e:  # reported by rank 0; the others stop with one line
                err = e
        ranks.agree(err)
        path = out
        record = ranks.broadcast(record)
        ranks.close()
    return CalibrationResult(
        path, record["model"], fingerprint, [tuple(g) for g in record["groups"]], record["num_samples"], num_tokens,
        config.scores, record["wall_time_s"], record,
    )


def choose_pipeline(config: CalibConfig, shapes) -> str:
    """``whole`` or ``sequential`` for ``--pipeline`` (``auto``: sequential when the weights do not
    fit the devices the whole model would use, and only for what sequential supports)."""
    if config.pipeline == "sequential":
        if config.scores == "kl":
            raise UserError("--pipeline sequential computes --scores grad or none, not kl: use --scores grad, or --pipeline whole")
        if config.weight_algo != "rtn":
            raise UserError("--weight-algo awq needs --pipeline whole for now")
        return "sequential"
    if config.pipeline == "whole" or config.scores == "kl" or config.weight_algo != "rtn":
        return "whole"
    import torch

    from resserve_export.modeling.modelio import parse_device

    # The loaded model's bytes: every tensor in the load dtype.
    bytes_ = sum(math.prod(shape) for _, shape in shapes.values()) * getattr(torch, config.dtype).itemsize
    d = parse_device(config.device)
    if d == "cpu" or not torch.cuda.is_available():
        from resserve_export.stages.calibrate.sequential import available_memory

        room = available_memory()
    elif d == "auto":
        room = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    else:
        room = torch.cuda.mem_get_info(torch.device(d))[0]
    return "whole" if bytes_ < 0.8 * room else "sequential"


def _check_moe_settings(config: CalibConfig, ranks: int) -> None:
    """What a mixture-of-experts calibration does not do yet, refused before any work."""
    if config.pipeline == "sequential":
        raise UserError("--pipeline sequential does not run mixture-of-experts models yet: use --pipeline whole; nothing was calibrated")
    if ranks > 1:
        raise UserError("mixture-of-experts models calibrate in one process for now: run without torchrun; nothing was calibrated")


def model_groups_of(net, model_dir, blocks=()) -> list[Group]:
    """The decision groups of a loaded (or weightless) model's ``nn.Linear`` modules, and of the
    experts of `blocks` (`experts.ExpertBlock`) under their checkpoint names, each block's at the
    place of its fused module."""
    fused = {}
    if blocks:
        from resserve_export.modeling.experts import fused_modules

        fused = {id(mod): b for b, mod in zip(blocks, fused_modules(net, list(blocks)).values())}
    linears = {}
    for n, m in net.named_modules():
        if _is_linear(m):
            linears[n] = (m.out_features, m.in_features)
        elif id(m) in fused:
            linears.update(fused[id(m)].linears())
    check_in_features(linears)
    experts = expert_modules([n for n in linears if is_quantized(n)])
    if experts and not blocks:
        raise UserError(f"mixture-of-experts linears (e.g. {experts[0]}) are not supported yet: calibrate a dense model")
    groups = group_linears(linears)
    if not groups:
        raise UserError(f"{model_dir} has no linear layers to quantize")
    return groups


def _sequential_groups(model_dir, config) -> tuple[list[Group], int]:
    """The decision groups and the number of decoder layers, from the weightless model."""
    from resserve_export.stages.calibrate.sequential import decoder_layers, empty_model

    shell = empty_model(model_dir, config.dtype)
    return model_groups_of(shell, model_dir), len(decoder_layers(shell)[1])


def _score_spec(config):
    from resserve_export.stages.calibrate.sequential import ScoreSpec

    if config.scores != "grad":
        return None
    return ScoreSpec(list(RATIOS), config.format, config.mx_scale, config.score_precision, config.score_samples)


def _collect_sequential(model_dir, out, config, batches, show_progress, on_batch, key, resume):
    from resserve_export.core.ui import say
    from resserve_export.stages.calibrate.sequential import collect_sequential
    from resserve_export.storage.resume import ResumePoints

    groups, n_layers = _sequential_groups(model_dir, config)
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    points = ResumePoints.open(out, {**key, "groups": [list(g.modules) for g in groups]}, resume, say=say)
    spill = temp_sibling(out, "offload")
    passes = n_layers * (2 if config.scores == "grad" else 1)
    try:
        with Progress("calibrating layer by layer", passes, unit="layer passes", enabled=show_progress) as bar:
            done = [0]

            def step(li: int, bi: int, n: int) -> None:
                if bi == n - 1:
                    bar.advance(1)
                    done[0] += 1
                    if on_batch is not None:
                        on_batch(done[0])

            spec = _score_spec(config)

            def resumed(n: int) -> None:
                bar.start_at(n)
                done[0] = n

            r = collect_sequential(
                model_dir, config.device, config.dtype, batches, groups, spill, progress=step, scores=spec,
                resume=points, on_resume=resumed,
            )
            stats, num_tokens, kv_stats, kv_problem, scores = r.stats, r.num_tokens, r.kv_stats, r.kv_problem, r.scores
    except UserError:
        points.finish()  # the same inputs would fail the same way
        raise
    except BaseException:
        # Interrupted, killed by the system, out of memory, disk full, ...: the state stays.
        where = points.where()
        if where is None:
            points.finish()  # nothing to continue from
        else:
            points.release()
            say(f"note: the run can continue from its last resume point ({where}): rerun the same command with --resume")
        raise
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    points.finish()
    return stats, num_tokens, kv_stats, kv_problem, groups, scores


def _collect_ranks_sequential(ranks, model_dir, out, config, batches, show_progress):
    """One data-parallel rank of the sequential pipeline: the layer passes over its share of the
    batches (and of the score samples), the statistics merged on rank 0 in global batch order
    between the forward and the backward passes and sent back to every rank (the candidates
    need them), then every score addition replayed on rank 0 in rank order: what one process
    computes. Returns (stats, num_tokens, kv statistics, why none, groups, scores or None)."""
    from resserve_export.algorithms.scores.batches import _take
    from resserve_export.stages.calibrate.sequential import collect_sequential

    stage = [0]  # 0: before the merge; 1: in it (its agreement done); 2: after it

    def combine(col, kvc):
        stage[0] = 1
        ranks.agree(None)
        merged = _merge_ranks(ranks, groups, col.parts(), kvc.result(), kvc.problem)
        stage[0] = 2
        return merged

    spec, log, spill, groups = _score_spec(config), {"adds": [], "tokens": 0}, None, []
    try:
        import torch

        groups, n_layers = _sequential_groups(model_dir, config)
        mine = ranks.share(batches)
        if not mine:
            raise UserError(f"{len(batches)} batches for {ranks.size} ranks: use more --num-samples or fewer ranks")
        score_mine, samples = None, 0
        if spec is not None:
            every = _take(batches, spec.samples, torch.device(config.device))
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

            r = collect_sequential(
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
    scores = _replay_scores(ranks, groups, log, local, samples, config) if config.scores == "grad" else None
    return stats, num_tokens, kv_stats, kv_problem, groups, scores


def _merge_ranks(ranks, groups, parts: dict, kv_stats, kv_problem) -> tuple:
    """Every rank's statistics (`StatsCollector.parts()`) and KV statistics, merged on rank 0 in
    one-process order (`distributed.merge_stats` / `merge_kv`) and sent to every rank: (stats,
    num_tokens, kv statistics, why none). A merge error is raised on every rank."""
    from resserve_export.core.distributed import merge_kv, merge_stats

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


def _replay_scores(ranks, groups, log: dict, local: dict | None, samples: int, config) -> dict | None:
    """The grad scores record of one process, on rank 0 (None elsewhere): every rank's score
    additions (`log`) replayed in rank order, over all ranks' loss tokens."""
    from resserve_export.algorithms.scores import scores_record
    from resserve_export.algorithms.scores.grad import ScoreSums

    logs = ranks.gather({**log, "precision": local["precision"] if local else None, "seconds": local["wall_time_s"] if local else 0.0})
    if ranks.rank != 0:
        return None
    return scores_record(
        ScoreSums.replay(logs).normalised(groups, list(RATIOS), sum(x["tokens"] for x in logs)), groups, list(RATIOS), "grad",
        samples, config.format, config.mx_scale, next((x["precision"] for x in logs if x["precision"]), config.score_precision),
        max(x["seconds"] for x in logs),
    )


def _collect_ranks(ranks, model_dir, config, batches, shapes, show_progress):
    """One data-parallel rank of the whole-model pipeline (see `distributed`): statistics of
    its share of the batches, merged on rank 0 in global batch order and sent back to every
    rank; then grad scores of its share of the score samples, replayed on rank 0. Returns what
    `_collect_whole` returns (stats and scores as one process would compute them)."""
    import torch

    from resserve_export.modeling import modelio
    from resserve_export.observers import kv as kvcache

    err, net = None, None
    try:
        net = modelio.load_model_on(model_dir, config.device, config.dtype)
        groups = model_groups_of(net, model_dir)
        # Every rank searches the same rows (the first of all batches) and gets the same scales.
        smoothing, weight_algo = _smooth(net, batches, groups, config, shapes, show_progress)
        mine = ranks.share(batches)
        with Progress(f"calibrating ({ranks.size} ranks)", len(mine), unit="batches", enabled=show_progress) as bar:
            kv = kvcache.KVCollector(net)
            parts, _ = collect(net, mine, groups, lambda n, t: bar.advance(1), kv=kv, parts=True)
            kv_local = kv.result()
    except BaseException as e:
        err = e
    ranks.agree(err)
    stats, num_tokens, kv_stats, kv_problem = _merge_ranks(ranks, groups, parts, kv_local, kv.problem)
    scores = None
    if config.scores == "grad":
        from resserve_export.algorithms.scores import compute_scores
        from resserve_export.algorithms.scores.batches import _take

        err, log = None, {"adds": [], "tokens": 0}
        try:
            score_batches = _take(batches, config.score_samples, torch.device(config.device))
            mine = ranks.share(score_batches)
            local = compute_scores(
                net, mine, stats, groups, "grad", list(RATIOS), config.format, None, rounding=config.mx_scale,
                show_progress=show_progress, precision=config.score_precision, log=log,
            ) if mine else None
        except BaseException as e:
            err = e
        ranks.agree(err)
        scores = _replay_scores(ranks, groups, log, local, sum(int(b["input_ids"].shape[0]) for b in score_batches), config)
    return stats, num_tokens, kv_stats, kv_problem, groups, smoothing, weight_algo, scores


def _smooth(net, batches, groups, config, shapes, show_progress, blocks=()):
    """With ``--weight-algo awq``: search the scales on `net` and smooth it in place, so that
    everything collected afterwards (salience, amax, KV statistics, expert statistics, scores)
    describes the smoothed model, with the values the checkpoint will store. `blocks`: a
    mixture-of-experts model's expert blocks. Returns (the `awq.Smoothing` or None,
    calibration.json's record)."""
    if config.weight_algo != "awq":
        return None, {"name": "rtn"}
    from resserve_export.algorithms.awq.decoder import plan_folds
    from resserve_export.algorithms.awq.pipeline import search_smoothing
    from resserve_export.modeling.experts import checkpoint_parameters

    blocks = list(blocks)
    with Progress("AWQ scale search", len(plan_folds(net, blocks, shapes)), unit="groups", enabled=show_progress) as bar:
        smoothing, record = search_smoothing(
            net, batches, groups, config.format, config.mx_scale, config.awq_tokens, progress=lambda: bar.advance(1),
            blocks=blocks, shapes=shapes, moe_calib=config.moe_calib,
        )
    # Experts as the slices of the fused parameters the collector computes with (checkpoint names).
    smoothing.apply_to_model(net, checkpoint_parameters(net, blocks))
    return smoothing, record


def _collect_whole(model_dir, out, config, batches, shapes, show_progress, on_batch, blocks=()):
    from resserve_export.modeling import modelio
    from resserve_export.observers import kv as kvcache

    offload = None
    try:
        if config.device == "auto":
            out.absolute().parent.mkdir(parents=True, exist_ok=True)
            offload = temp_sibling(out, "offload")
        net = modelio.load_model_on(model_dir, config.device, config.dtype, offload_folder=offload)
        groups = model_groups_of(net, model_dir, blocks)
        smoothing, weight_algo = _smooth(net, batches, groups, config, shapes, show_progress, blocks)

        total = sum(int(b["input_ids"].shape[0]) for b in batches)
        with Progress("calibrating", total, unit="samples", rate_unit="tok", enabled=show_progress) as bar:
            done = [0]

            def step(n_samples: int, n_tokens: int) -> None:
                bar.advance(n_samples, rate=n_tokens)
                done[0] += 1
                if on_batch is not None:
                    on_batch(done[0])

            kv = kvcache.KVCollector(net)
            moe = None
            if blocks:
                from resserve_export.modeling.experts import is_expert
                from resserve_export.observers.experts import ExpertCollector

                dense = [g for g in groups if not is_expert(g.modules[0])]
                with ExpertCollector(net, list(blocks), config.moe_calib) as ec:
                    stats, num_tokens = collect(net, batches, dense, step, kv=kv, experts=ec)
                expert_stats, moe = ec.result()
                stats.update(expert_stats)
                _warn_fallbacks(ec.fallbacks)
            else:
                stats, num_tokens = collect(net, batches, groups, step, kv=kv)
            kv_stats = kv.result()

        scores = None
        if config.scores != "none":
            from contextlib import nullcontext

            from resserve_export.algorithms.scores import compute_scores
            from resserve_export.modeling.experts import unfused

            # Experts scored as per-expert linears under their checkpoint names, with the true routing.
            with unfused(net, list(blocks)) if blocks else nullcontext():
                scores = compute_scores(
                    net, batches, stats, groups, config.scores, list(RATIOS), config.format, config.score_samples,
                    rounding=config.mx_scale, show_progress=show_progress, precision=config.score_precision,
                )
    finally:
        if offload is not None:
            shutil.rmtree(offload, ignore_errors=True)
    return stats, num_tokens, kv_stats, kv.problem, groups, smoothing, weight_algo, scores, moe


def _warn_fallbacks(experts: list[str]) -> None:
    if experts:
        from resserve_export.core.ui import say

        more = f" and {len(experts) - 5} more" if len(experts) > 5 else ""
        say(
            f"warning: {len(experts)} experts saw no calibration token ({', '.join(experts[:5])}{more}): they take their "
            "layer's pooled expert statistics; calibrate with --moe-calib all or more samples for their own"
        )


def _is_linear(m) -> bool:
    import torch

    return isinstance(m, torch.nn.Linear)


def _quantized_linears(shapes) -> dict[str, tuple[int, int]]:
    from resserve_export.modeling.groups import linears_from_shapes

    return {k: v for k, v in linears_from_shapes(shapes).items() if is_quantized(k)}
