"""`Collected`: what a calibration pipeline (whole-model, layer-by-layer, or either under
data-parallel ranks) hands to `calibrate`, which writes it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from resserve_export.algorithms.awq.smoothing import Smoothing
from resserve_export.modeling.groups import Group


def _rtn() -> dict:
    return {"name": "rtn"}


@dataclass
class Collected:
    """The statistics of one calibration run, as one process computes them.

    `stats`: salience.safetensors' tensors (``<module>.mean_abs``, ``<module>.amax``); `kv_stats`:
    the KV-cache statistics, or None with `kv_problem` saying why; `scores`: scores.json's record
    (None with ``--scores none``, and on ranks other than 0); `smoothing` and `weight_algo`: the
    AWQ scales (None without ``--weight-algo awq``) and calibration.json's record of the weight
    algorithm; `moe`: calibration.json's record of a mixture-of-experts calibration; `gptq`: the
    GPTQ-quantized linears (None without GPTQ)."""

    stats: dict[str, torch.Tensor]
    num_tokens: int
    kv_stats: dict | None
    kv_problem: str | None
    groups: list[Group]
    scores: dict | None = None
    smoothing: Smoothing | None = None
    weight_algo: dict = field(default_factory=_rtn)
    moe: dict | None = None
    gptq: dict | None = None  # {module: FP4Tensor} of ``--weight-algo gptq`` / ``awq+gptq``
