"""The layer-by-layer pipeline (``--pipeline sequential``) in one process: the decision groups
from the weightless model, the progress bar over layer passes, the spill directory, and the
resume points of ``--resume`` around `sequential.collect_sequential`."""

from __future__ import annotations

import shutil

from resserve_export.core.errors import UserError
from resserve_export.core.outputs import temp_sibling
from resserve_export.core.ui import Progress, say
from resserve_export.formats.constants import RATIOS
from resserve_export.modeling.groups import Group
from resserve_export.stages.calibrate import sequential
from resserve_export.stages.calibrate.backward import ScoreSpec
from resserve_export.stages.calibrate.shell import decoder_layers, empty_model
from resserve_export.stages.calibrate.collected import Collected
from resserve_export.stages.calibrate.config import CalibConfig, note_slow_bf16
from resserve_export.stages.calibrate.linears import model_groups_of
from resserve_export.storage.resume import ResumePoints


def sequential_groups(model_dir, config: CalibConfig) -> tuple[list[Group], int]:
    """The decision groups and the number of decoder layers, from the weightless model."""
    shell = empty_model(model_dir, config.dtype)
    return model_groups_of(shell, model_dir), len(decoder_layers(shell)[1])


def score_spec(config: CalibConfig) -> ScoreSpec | None:
    """What ``--scores`` asks of the layer-by-layer pipeline (None: no scores)."""
    if config.scores != "grad":
        return None
    return ScoreSpec(list(RATIOS), config.format, config.mx_scale, config.score_precision, config.score_samples)


def collect_by_layer(model_dir, out, config: CalibConfig, batches, show_progress, on_batch, key: dict, resume: bool) -> Collected:
    """The layer-by-layer pipeline in one process. `key`: what a resume point must match (the
    model, the samples, the settings); `resume`: continue from the saved resume point of `out`.
    `on_batch` is called with the number of layer passes done after each one."""
    groups, n_layers = sequential_groups(model_dir, config)
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    points = ResumePoints.open(out, {**key, "groups": [list(g.modules) for g in groups]}, resume, say=say)
    if show_progress:
        note_slow_bf16(config)
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

            spec = score_spec(config)

            def resumed(n: int) -> None:
                bar.start_at(n)
                done[0] = n

            gptq_format = (config.format, config.mx_scale, config.gptq_order) if config.weight_algo == "gptq" else None
            r = sequential.collect_sequential(
                model_dir, config.device, config.dtype, batches, groups, spill, progress=step, scores=spec,
                resume=points if gptq_format is None else None, on_resume=resumed, gptq_format=gptq_format,
                gptq_propagate=config.gptq_propagate,
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
    if r.gptq is None:
        return Collected(stats, num_tokens, kv_stats, kv_problem, groups, scores)
    return Collected(stats, num_tokens, kv_stats, kv_problem, groups, scores, weight_algo=r.gptq_record, gptq=r.gptq)
