"""Calibration: activation salience (mean |x| per input channel) and amax of every quantized linear.

Forward pre-hooks sit on the first member of each decision group (q/k/v and gate/up read one
input, so one record serves the group: docs/formats.md, "Channel selection and masks"). Per batch
a hook takes |x| of the valid (non-padding) tokens once, reduces it over tokens in float32
(float64 for a float64 model) and adds the result to a float64 accumulator, never one in the
model dtype (docs/formats.md, "Calibration"); amax is kept as a running maximum. Non-finite activations are caught once per batch
and reported with the first layer, in forward order, that saw them.

`calibrate` runs one of the pipelines (`whole.collect_whole`, `by_layer.collect_by_layer`, or
either on data-parallel ranks: `ranks`), chosen by `choose_pipeline`, and writes what it
`Collected`: the calibration dir, written atomically by :func:`write_dir_atomic`:
``salience.safetensors`` (``<module>.mean_abs`` float32 ``[in_features]``, ``<module>.amax`` float32
0-d, for every quantized linear), ``calibration.json`` (provenance; the only run-dependent field is
``wall_time_s``), and with ``--scores`` a ``scores.json`` from :mod:`resserve_export.algorithms.scores`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from resserve_export.algorithms import gptq
from resserve_export.core import devices
from resserve_export.core.distributed import Ranks, world_size
from resserve_export.core.errors import UserError
from resserve_export.core.outputs import check_out_dir, clean_stale, write_dir_atomic
from resserve_export.modeling import data, families, forward, modelio
from resserve_export.modeling.experts import expert_blocks
from resserve_export.observers import kv as kvcache
from resserve_export.stages.calibrate import sequential
from resserve_export.stages.calibrate.by_layer import collect_by_layer
from resserve_export.stages.calibrate.collected import Collected
from resserve_export.stages.calibrate.config import CalibConfig
from resserve_export.stages.calibrate.linears import (
    check_in_features,
    quantized_linears,
)
from resserve_export.stages.calibrate.ranks import (
    collect_ranks,
    collect_ranks_sequential,
    start_ranks,
)
from resserve_export.stages.calibrate.whole import collect_whole
from resserve_export.storage import kv_stats as kv_file
from resserve_export.storage.calibration import save_stats, versions


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
    t0 = time.perf_counter()
    config.validate()
    out = Path(out)
    check_out_dir(out, overwrite)
    clean_stale(out)
    devices.parse_device(config.device)
    model_dir = modelio.resolve_model(model)
    modelio.check_architecture(model_dir, "calibrate")
    shapes = modelio.tensor_shapes(model_dir)
    blocks = expert_blocks(shapes, "calibrated")
    cfg = json.loads((model_dir / "config.json").read_text())
    families.check_weight_algo(cfg, config.weight_algo, "calibrated")
    if blocks:
        _check_moe_settings(config, world_size())
    check_in_features(quantized_linears(shapes))
    fingerprint = modelio.fingerprint(model_dir)
    docs = data.load_documents(config.dataset)
    tokenizer = modelio.load_tokenizer(model_dir)
    samples = data.make_samples(tokenizer, docs, config.num_samples, config.seq_len, config.seed)
    batches = data.batches(samples, config.batch_size, data.pad_id(tokenizer))

    ranks = None
    if world_size() > 1:
        ranks, config = start_ranks(config, resume)
    pipeline = "whole" if blocks else choose_pipeline(config, shapes)
    if ranks is not None:
        pipeline = ranks.broadcast(pipeline)  # auto: rank 0's choice (free memory differs by device)
    if not blocks:  # a GPU runs big batches in pieces (`forward.GPU_ACTIVATION_BYTES`); experts bound their own buffers
        rows = forward.micro_batch_rows(cfg, getattr(torch, config.dtype).itemsize, devices.resolve_device(config.device))
        batches = data.micro_batches(batches, rows)
    if resume and pipeline != "sequential":
        raise UserError("--resume continues a layer-by-layer run: pass --pipeline sequential with the interrupted run's settings")
    if resume and config.weight_algo == "gptq":
        raise UserError("--resume does not continue a GPTQ calibration (it keeps no resume points): run it again without --resume")
    samples_sha256, versions_ = data.samples_digest(samples), versions()
    if ranks is not None:
        got = _collect_on_ranks(ranks, pipeline, model_dir, out, config, batches, shapes, show_progress and ranks.rank == 0)
    elif pipeline == "sequential":
        # What a resume point must match (the pipeline may differ).
        key = {"fingerprint": fingerprint, "samples_sha256": samples_sha256, "versions": versions_}
        key.update({k: v for k, v in asdict(config).items() if k != "pipeline"})
        got = collect_by_layer(model_dir, out, config, batches, show_progress, on_batch, key, resume)
    else:
        got = collect_whole(model_dir, out, config, batches, shapes, show_progress, on_batch, blocks)
    if got.scores is not None:
        got.scores["fingerprint"] = fingerprint

    record = {
        "model": modelio.model_label(model),
        "model_dir": str(model_dir),
        "fingerprint": fingerprint,
        "fingerprint_method": modelio.FINGERPRINT_METHOD,
        "architecture": modelio.architecture_key(model_dir),
        "dataset": config.dataset,
        "num_samples": len(samples),
        "num_tokens": got.num_tokens,
        "seq_len": config.seq_len,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "samples_sha256": samples_sha256,
        "dtype": config.dtype,
        "device": config.device,
        "scores": config.scores,
        "versions": versions_,
        **_collected_record(got, pipeline),
        "config": asdict(config),
    }
    if got.moe is not None:
        record["moe"] = got.moe
    path, record = _write(out, got, record, t0, overwrite, ranks)
    return CalibrationResult(
        path, record["model"], fingerprint, [tuple(g) for g in record["groups"]], record["num_samples"], got.num_tokens,
        config.scores, record["wall_time_s"], record,
    )


def _collect_on_ranks(ranks: Ranks, pipeline: str, model_dir, out, config, batches, shapes, show_progress) -> Collected:
    """This data-parallel rank's part of `pipeline` (the sequential pipeline does not smooth:
    AWQ needs the whole model)."""
    if pipeline == "sequential":
        return collect_ranks_sequential(ranks, model_dir, out, config, batches, show_progress)
    return collect_ranks(ranks, model_dir, config, batches, shapes, show_progress)


def _collected_record(got: Collected, pipeline: str) -> dict:
    """calibration.json's fields that describe what the pipeline collected."""
    return {
        "groups": [list(g.modules) for g in got.groups],
        "pipeline": pipeline,
        "weight_algo": got.weight_algo,
        "kv_cache": (
            {"file": kv_file.FILE, "point": kvcache.POINT, "layers": len(got.kv_stats)}
            if got.kv_stats is not None
            else {"file": None, "why_not": got.kv_problem}
        ),
    }


def _write(out: Path, got: Collected, record: dict, t0: float, overwrite: bool, ranks: Ranks | None) -> tuple[Path, dict]:
    """Write the calibration dir atomically (under ranks: rank 0 writes, every rank gets its
    record); returns its path and calibration.json's record."""

    def write(tmp: Path) -> None:
        save_stats(got.stats, tmp / "salience.safetensors")
        if got.smoothing is not None:
            got.smoothing.save(tmp / got.weight_algo["file"])
        if got.gptq is not None:
            gptq.save(got.gptq, tmp / got.weight_algo["gptq_file"])
        if got.kv_stats is not None:
            kv_file.save(got.kv_stats, tmp / kv_file.FILE)
        if got.scores is not None:
            (tmp / "scores.json").write_text(json.dumps(got.scores, indent=2) + "\n")
        record["wall_time_s"] = round(time.perf_counter() - t0, 3)
        (tmp / "calibration.json").write_text(json.dumps(record, indent=2) + "\n")

    if ranks is None:
        return write_dir_atomic(out, write, overwrite), record
    record["data_parallel"] = {"ranks": ranks.size, "backend": ranks.backend}
    err = None
    if ranks.rank == 0:
        try:
            write_dir_atomic(out, write, overwrite)
        except BaseException as e:  # reported by rank 0; the others stop with one line
            err = e
    ranks.agree(err)
    record = ranks.broadcast(record)
    ranks.close()
    return out, record


def choose_pipeline(config: CalibConfig, shapes) -> str:
    """``whole`` or ``sequential`` for ``--pipeline`` (``auto``: sequential when the weights do not
    fit the devices the whole model would use, and only for what sequential supports)."""
    if config.pipeline == "sequential" or config.gptq_propagate:
        if config.scores == "kl":
            raise UserError("--pipeline sequential computes --scores grad or none, not kl: use --scores grad, or --pipeline whole")
        if "awq" in config.weight_algo.split("+"):
            raise UserError(f"--weight-algo {config.weight_algo} needs --pipeline whole for now")
        return "sequential"
    if config.pipeline == "whole" or config.scores == "kl" or "awq" in config.weight_algo.split("+"):
        return "whole"
    # The loaded model's bytes: every tensor in the load dtype.
    bytes_ = sum(math.prod(shape) for _, shape in shapes.values()) * getattr(torch, config.dtype).itemsize
    d = devices.parse_device(config.device)
    if d == "cpu" or not torch.cuda.is_available():
        room = sequential.available_memory()
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
