"""The Python API: the tool's five steps as functions with typed results.

    from resserve_export import api

    cal = api.calibrate("default", "calib", config="quick")
    plan = api.plan("calib", budget=5.0)
    ck = api.pack("default", "calib", "ckpt", fmt="nvfp4", plan=plan.path)
    rep = api.verify("ckpt", "default", calib="calib", out="verify-out")
    size = api.size("path/to/config.json", fmt="mxfp4", ratio=0.25)

The CLI commands are thin callers of these functions (same files, same bytes). Bad input raises
`resserve_export.errors.UserError` with a one-line message (`CheckpointMismatch` from `verify`
when the checkpoint was not packed from the model). A call leaves process-wide settings as it
found them: the libraries' logging and progress bars, the hub's offline switch, Dynamo's
recompile limits, environment variables and torch's thread count are restored on return.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from resserve_export.core import compiling
from resserve_export.core.errors import UserError
from resserve_export.core.outputs import check_writable
from resserve_export.planners import SOLVERS
from resserve_export.stages import plan as P
from resserve_export.stages.calibrate import run as cal
from resserve_export.stages.calibrate.config import make_config
from resserve_export.stages.calibrate.run import CalibrationResult
from resserve_export.stages.pack import run as _pack_module
from resserve_export.stages.pack.run import PackResult
from resserve_export.stages.size import (
    SizeReport,
    estimate,
    load_config,
    other_files_bytes,
)
from resserve_export.stages.verify.run import verify as _verify

# transformers (3 to 5 s to import after torch), datasets (about 3 s) and huggingface_hub are
# imported inside `_snapshot` / `_restore`, which only the model-loading stages call: the
# CLI imports this module for every command, `size` and `--help` included (python -X importtime).


@dataclass(frozen=True)
class PlanResult:
    """A written plan: `ratios` maps each decision group's name to its prefill ratio."""

    path: Path
    chart: Path | None
    budget: float
    achieved_bits: float
    method: str
    solver: str
    objective: float
    ratios: dict[str, float]
    solve_seconds: float
    data: dict  # plan.json's content


@dataclass(frozen=True)
class VerifyResult:
    """What `verify` measured; `report` is verify.json's content."""

    path: Path | None
    format: str
    model_dtype: str
    weights_match: bool | None  # None: not checked
    pooled_nmse: dict[str, float]  # plain, checkpoint, full, ratio_0.125, ...
    perplexity: dict[str, float]  # bf16 (the source model, whatever its dtype), plain, checkpoint, full
    report: dict


# ----------------------------------------------------------------------------- process state


def _snapshot() -> dict:

    state: dict = {"env": dict(os.environ), "threads": torch.get_num_threads()}
    cfg = torch._dynamo.config
    state["dynamo"] = {k: getattr(cfg, k) for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit") if hasattr(cfg, k)}
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        state["transformers"] = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants as hub

        state["hub_offline"] = hub.HF_HUB_OFFLINE
    if "datasets" in sys.modules:
        import datasets
        import datasets.config
        from datasets.utils import logging as ds_logging

        state["datasets"] = (datasets.config.HF_HUB_OFFLINE, ds_logging.get_verbosity(), datasets.is_progress_bar_enabled())
    return state


def _restore(state: dict) -> None:
    """Put back what `_snapshot` saw; a library first imported during the call gets its defaults."""

    for k in set(os.environ) - set(state["env"]):
        del os.environ[k]
    for k, v in state["env"].items():
        if os.environ.get(k) != v:
            os.environ[k] = v
    torch.set_num_threads(state["threads"])
    cfg = torch._dynamo.config
    for k, v in state["dynamo"].items():
        setattr(cfg, k, v)

    compiling.forget_raised_limits()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        verbosity, bars = state.get("transformers", (hf_logging.WARNING, True))
        hf_logging.set_verbosity(verbosity)
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants as hub

        hub.HF_HUB_OFFLINE = state["hub_offline"] if "hub_offline" in state else _env_offline()
    if "datasets" in sys.modules:
        import datasets
        import datasets.config
        from datasets.utils import logging as ds_logging

        offline, verbosity, bars = state.get("datasets", (_env_offline(), ds_logging.WARNING, True))
        datasets.config.HF_HUB_OFFLINE = offline
        ds_logging.set_verbosity(verbosity)
        (datasets.enable_progress_bars if bars else datasets.disable_progress_bars)()


def _env_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


@contextmanager
def restoring_process_state():
    """Restore, on exit, the process-wide settings the steps change (see the module docstring)."""
    state = _snapshot()
    try:
        yield
    finally:
        _restore(state)


# ----------------------------------------------------------------------------- the steps


def calibrate(
    model: str, out: str | os.PathLike, *, config: str | None = None, overwrite: bool = False, progress: bool = True, resume: bool = False,
    **settings,
) -> CalibrationResult:
    """Salience, amax and (by default grad) planner scores of `model` into the directory `out`.

    `config`: a preset name (``paper``, ``quick``) or YAML file; `settings` override it (any
    field of `stages.calibrate.config.CalibConfig`: ``dataset``, ``num_samples``, ``seq_len``, ``batch_size``,
    ``seed``, ``device``, ``dtype``, ``scores``, ``score_samples``, ``score_precision``,
    ``format``, ``mx_scale``, ``weight_algo`` (``rtn``, ``awq``, ``gptq`` or ``awq+gptq``), ``awq_tokens``, ``gptq_order``
    (``activation`` or ``block``), ``gptq_propagate`` (GPTQ layer by layer, each layer's outputs recomputed through its
    GPTQ weights), ``pipeline``
    (``auto``, ``whole`` or ``sequential``), ``moe_calib`` (``all`` or ``routed``: the tokens a
    mixture-of-experts model's experts take their statistics from)). `resume`: continue an interrupted layer-by-layer
    (sequential) run of the same `out` from its last resume point.
    """

    with restoring_process_state():
        cfg = make_config(config, **settings)
        return cal.calibrate(model, Path(out), cfg, overwrite=overwrite, show_progress=progress, resume=resume)


def plan(
    calib: str | os.PathLike,
    budget: float,
    *,
    ratios: str | list[float] | None = None,
    solver: str = "cbc",
    out: str | os.PathLike | None = None,
    chart: bool = True,
    allow_other_weights: bool = False,
    moe_ratio: str = "shared",
    moe_cost: str = "bits",
) -> PlanResult:
    """Per-group prefill ratios for `budget` effective bits from the stored scores; writes
    ``plan.json`` (default: in `calib`) and, with `chart`, ``plan.png`` beside it.

    Mixture-of-experts models: `moe_ratio` ``shared`` (one ratio per layer and projection kind
    across that layer's experts) or ``per-expert``; `moe_cost` ``bits`` (stored weights) or
    ``tokens`` (weights times each expert's routed-token share)."""

    with restoring_process_state():
        if solver not in SOLVERS:
            raise UserError(f"unknown solver {solver!r}, available: {', '.join(SOLVERS)}")
        if solver == "highs":
            from resserve_export.planners.ilp import available

            if not available("highs"):
                raise UserError("the HiGHS solver needs the 'highspy' package: `pip install highspy`, or use --solver cbc")
        P.check_budget(budget)
        scores, calibration = P.read_scores(Path(calib), allow_other_weights)
        text = ratios if ratios is None or isinstance(ratios, str) else ",".join(str(r) for r in ratios)
        chosen = P.parse_ratios(text, P.scored_ratios(scores))
        path = Path(out) if out is not None else Path(calib) / P.PLAN_FILE
        if path.is_dir():
            raise UserError(f"--out {path} is a directory: pass a file name such as {path / P.PLAN_FILE}")
        check_writable(path)
        t0 = time.perf_counter()
        data = P.build_plan(scores, budget, ratios=chosen, solver=solver, calibration=calibration, moe_ratio=moe_ratio, moe_cost=moe_cost)
        solve_s = time.perf_counter() - t0
        chart_path = P.write_plan(data, path, with_chart=chart)
    by_group = {"+".join(g["modules"]): float(g["ratio"]) for g in data["groups"]}
    return PlanResult(
        path, chart_path, data["budget"], data["achieved_bits"], data["method"], data["solver"], data["objective"], by_group, solve_s, data
    )


def _restored(fn):
    """`fn` under `restoring_process_state` (same signature and docstring)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with restoring_process_state():
            return fn(*args, **kwargs)

    return call


# The FP4 checkpoint of a model from a calibration and one ratio or a plan (`pack.pack`).
pack = _restored(_pack_module.pack)


def verify(
    ckpt: str | os.PathLike,
    model: str,
    *,
    calib: str | os.PathLike | None = None,
    text: str | None = None,
    samples: int = 4,
    seq_len: int = 256,
    device: str = "auto",
    max_tokens: int = 4096,
    check_weights: bool = True,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress=None,
) -> VerifyResult:
    """Check the checkpoint against `model`, then measure NMSE and perplexity (see `verify.verify`).

    `progress`: None, or ``tick(phase, advance, total)`` (`ui.phases` gives one).
    """

    with restoring_process_state():
        rep = _verify(
            ckpt, model, text=text, samples=samples, seq_len=seq_len, calib=calib, device=device, max_tokens=max_tokens,
            check_weights=check_weights, out=out, overwrite=overwrite, progress=progress,
        )
    return VerifyResult(
        Path(out) if out is not None else None, rep["format"], rep["model_dtype"], rep["weights_match_reference"],
        dict(rep["nmse"]["pooled"]), dict(rep["perplexity"]), rep,
    )


def size(
    config: str | os.PathLike,
    fmt: str = "nvfp4",
    *,
    ratio: float | None = None,
    plan: str | os.PathLike | None = None,
    other_bytes: int | None = None,
    max_shard_size: str | int = "5GB",
    kv_cache: str = "none",
    experts_layout: str = "per-expert",
) -> SizeReport:
    """Bytes `pack` would write for a model, from its config.json (or directory) alone.

    `other_bytes`: config, tokenizer and other copied files; None measures them beside the config.
    `experts_layout`: as `pack`'s (``hub``: gpt-oss's experts as the hub's MXFP4 blocks).
    """

    cfg, where = load_config(config)
    if other_bytes is None:
        other_bytes = other_files_bytes(where) if where is not None else 0
    return estimate(
        cfg, fmt, ratio=ratio, plan=plan, other_bytes=other_bytes, max_shard_size=max_shard_size, kv_cache=kv_cache, experts_layout=experts_layout
    )


__all__ = ["calibrate", "plan", "pack", "verify", "size", "CalibrationResult", "PlanResult", "PackResult", "VerifyResult", "SizeReport", "restoring_process_state"]
