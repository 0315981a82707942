"""The memory-budgeted store of candidates that `compute_scores` scores from.

Building a group's `candidates.Candidates` is the costly part (every member quantized at every
ratio), and keeping all of them may not fit: `CandidatePool` keeps the groups that fit a byte
budget (`default_budget`: half the memory free on the device) and rebuilds the others per
batch. Candidates are deterministic, so the scores are the same bits either way. The bytes a
group takes per weight depend on the precision and layout (`precision.bytes_per_weight_of`).
"""

from __future__ import annotations

import os

import torch

from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.algorithms.scores.candidates import Candidates


def default_budget(device: torch.device) -> int:
    """Bytes the scores may spend on kept candidates: half the memory free on `device` now
    (``RESSERVE_SCORE_MEMORY_GB`` overrides)."""
    env = os.environ.get("RESSERVE_SCORE_MEMORY_GB")
    if env:
        return int(float(env) * 2**30)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * 0.5)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.5)
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


class CandidatePool:
    """Candidates built on demand, memory-bounded: groups are kept (in the order first asked
    for) while their estimated size fits `budget` bytes; any other group is built when asked for
    and dropped by the caller after use, so a model whose candidates do not fit is scored with
    one extra group at a time, at the price of quantizing those groups' weights once per batch.
    Built candidates are the same either way (deterministic), so the scores are too."""

    def __init__(self, model, groups, stats, ratios, fmt, rounding, budget: int, bytes_per_weight: float, base_weights: dict | None = None):
        self.model, self.stats, self.ratios, self.fmt, self.rounding = model, stats, ratios, fmt, ScaleRounding(rounding)
        self.base_weights = base_weights
        self.groups = {g.modules: g for g in groups}
        self.budget, self.bytes_per_weight = budget, bytes_per_weight
        self.kept: dict[tuple[str, ...], Candidates] = {}
        self.used, self.builds = 0, 0

    def __getitem__(self, key: tuple[str, ...]) -> Candidates:
        if key in self.kept:
            return self.kept[key]
        g = self.groups[key]
        cand = Candidates(self.model, g, self.stats, self.ratios, self.fmt, self.rounding, self.base_weights)
        self.builds += 1
        size = g.weight_count * self.bytes_per_weight
        if self.used + size <= self.budget:
            self.kept[key] = cand
            self.used += size
        return cand

    def prebuild(self, order, progress=None) -> None:
        """Build (and keep) the groups that fit, in `order`, reporting ``progress(done, total)``."""
        order = list(order)
        for k, key in enumerate(order):
            if key not in self.kept and self.used + self.groups[key].weight_count * self.bytes_per_weight <= self.budget:
                self[key]
            if progress is not None:
                progress(k + 1, len(order))

