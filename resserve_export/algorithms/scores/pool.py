"""The memory-budgeted store of candidates that `compute_scores` scores from.

Building a group's `candidates.Candidates` is the costly part (every member quantized at every
ratio), and keeping all of them may not fit: `CandidatePool` keeps the groups that fit a byte
budget (`default_budget`: half the memory free on the device) and rebuilds the others per
batch. Candidates are deterministic, so the scores are the same bits either way. The bytes a
group takes per weight depend on the precision and layout (`precision.bytes_per_weight_of`).

On CUDA the grad scores build each group that fits in the first forward pass, as its first
member runs (`CandidatePool.build_in_forward`), on a CUDA stream of their own: the host builds a
group while the GPU works through the forward launched before it, instead of the GPU idling
through a build of every group before the first batch (``RESSERVE_BUILD_IN_FORWARD=0`` builds
them first). With ``RESSERVE_BUILD_AHEAD=1`` (opt-in: on an H100 it made the scores from scratch slower, 1.5
and 2.2 s against 1.2 and 1.6 s building first, as the build thread takes host time from the
scoring's launches; bench/results/plan.md) the grad
scores build the groups that fit ahead of their use (`CandidatePool.build_ahead`):
a thread of its own builds them on a CUDA stream of its own, last layer first (the order the
backward pass asks for them), while the first batch's forward and backward run, instead of all
of them before the first batch. Building a group is mostly host work (about 2 ms a group, a
tenth of it GPU time, bench/results/plan.md), so it overlaps the model's passes. A group asked
for before it is built waits for it; the candidates are the same bits either way.
"""

from __future__ import annotations

import os
import threading
from contextlib import nullcontext
from typing import Callable

import torch

from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.algorithms.scores.candidates import Candidates
from resserve_export.algorithms.scores.worker import enter_thread


def default_budget(device: torch.device) -> int:
    """Bytes the scores may spend on kept candidates: half the memory free on `device` now
    (``RESSERVE_SCORE_MEMORY_GB`` overrides). On CUDA, free includes what PyTorch's caching
    allocator holds without using it (reserved − allocated): the driver counts that as taken,
    yet the candidates' allocations reuse it first. After a calibration pass or an earlier run
    that cache can be most of the card, and the driver's figure alone left groups out of the
    budget, to be quantized again in every batch."""
    env = os.environ.get("RESSERVE_SCORE_MEMORY_GB")
    if env:
        return int(float(env) * 2**30)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int((torch.cuda.mem_get_info(device)[0] + max(cached, 0)) * 0.5)
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
        self._ahead: _Ahead | None = None
        self._later: _InForward | None = None

    def __getitem__(self, key: tuple[str, ...]) -> Candidates:
        if self._ahead is not None and key in self._ahead.pending:
            return self._ahead.take(key)
        if self._later is not None and self._later.owns(key):
            return self._later.take(key)
        if key in self.kept:
            return self.kept[key]
        cand = self._build(key)
        size = self.groups[key].weight_count * self.bytes_per_weight
        if self.used + size <= self.budget:
            self.kept[key] = cand
            self.used += size
        return cand

    def _build(self, key: tuple[str, ...]) -> Candidates:
        """Group `key`'s candidates, built now (counted in `builds`)."""
        cand = Candidates(self.model, self.groups[key], self.stats, self.ratios, self.fmt, self.rounding, self.base_weights)
        self.builds += 1
        return cand

    def _fits(self, order) -> list:
        """The keys of `order` not yet kept that fit the budget, in order, counted as used."""
        out = []
        for key in order:
            size = self.groups[key].weight_count * self.bytes_per_weight
            if key not in self.kept and key not in out and self.used + size <= self.budget:
                out.append(key)
                self.used += size
        return out

    def build_ahead(self, order, progress=None, prepare: Callable[[Candidates], None] | None = None) -> None:
        """Start building (and keeping) the groups that fit, in `order`, on a thread of their own
        (`_Ahead`); `__getitem__` waits for a group still being built. `prepare(candidates)` runs
        on the thread after each build (the bf16 weight operands). `close` ends the thread."""
        self._ahead = _Ahead(self, self._fits(list(order)), progress, prepare)

    def build_in_forward(self, order, progress=None, prepare: Callable[[Candidates], None] | None = None) -> None:
        """Keep the groups that fit, in `order`, but build each one when `warm` is called for it
        (the grad scores call it from the first forward pass, as the group's first member runs),
        on a CUDA stream of its own (`_InForward`), or when first asked for. `prepare(candidates)`
        runs after each build (the bf16 weight operands)."""
        self._later = _InForward(self, self._fits(list(order)), progress, prepare)

    def warm(self, key: tuple[str, ...]) -> None:
        """Build group `key` now if `build_in_forward` left it for later (else nothing)."""
        if self._later is not None:
            self._later.build(key)

    def close(self, raise_error: bool = True) -> None:
        """Wait for a `build_ahead` thread to end (raising its error, if any and `raise_error`)."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            ahead.close(raise_error)
        if self._later is not None:
            later, self._later = self._later, None
            later.close()

    def prebuild(self, order, progress=None) -> None:
        """Build (and keep) the groups that fit, in `order`, reporting ``progress(done, total)``."""
        keys = self._fits(list(order))
        for k, key in enumerate(keys):
            self.kept[key] = self._build(key)
            if progress is not None:
                progress(k + 1, len(keys))


class _Ahead:
    """The thread of `CandidatePool.build_ahead`: builds `keys` in order, on the pool's device
    with a CUDA stream of its own (a host sync in a build then waits for the builds only, not for
    the model's queued kernels), and records an event after each group. `take` waits for a
    group's build, makes the caller's stream wait for its event and returns it (kept in the pool).
    The thread stops at its first error, which `take` and `close` raise."""

    def __init__(self, pool: CandidatePool, keys: list, progress, prepare):
        self.pool, self.keys, self.progress, self.prepare = pool, keys, progress, prepare
        self.pending = set(keys)
        self.done = {key: threading.Event() for key in keys}
        self.events: dict = {}
        self.error: BaseException | None = None
        self.stop = False
        self.device = _device(pool)
        self.threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self._run, name="resserve-candidates", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            enter_thread(self.device, self.threads)
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            for k, key in enumerate(self.keys):
                if self.stop:
                    break
                cand = _build_on(self.pool, key, stream, self.prepare, self.events)
                self.pool.kept[key] = cand
                self.done[key].set()
                if self.progress is not None:
                    self.progress(k + 1, len(self.keys))
        except BaseException as e:  # raised by `take` / `close`
            self.error = e
        finally:
            for ev in self.done.values():  # nobody waits forever on a group that will not come
                ev.set()

    def take(self, key) -> Candidates:
        self.done[key].wait()
        if key not in self.pool.kept:
            raise self.error if self.error is not None else RuntimeError(f"candidates of {key} were not built")
        self.pending.discard(key)
        _wait_for(self.events, key, self.device)
        return self.pool.kept[key]

    def close(self, raise_error: bool) -> None:
        self.stop = True
        self.thread.join()
        _release(self.device)
        if self.error is not None and raise_error:
            raise self.error



class _InForward:
    """The groups of `CandidatePool.build_in_forward`. A build runs on a CUDA stream of its own,
    so its host syncs (the weight α read back, copies from host memory) wait for the builds'
    own kernels, not for the model's forward queued on the main stream: the host does a group's
    build while the GPU runs the forward launched before it. An event recorded after each build
    is waited for by the stream that first uses the group (`take`)."""

    def __init__(self, pool: CandidatePool, keys: list, progress, prepare):
        self.pool, self.progress, self.prepare = pool, progress, prepare
        self.pending = dict.fromkeys(keys)
        self.total = len(keys)
        self.events: dict = {}
        self.device = _device(pool)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def owns(self, key) -> bool:
        return key in self.pending or key in self.events

    def build(self, key) -> None:
        if key not in self.pending:
            return
        with torch.no_grad():  # inside the model's forward: no autograd history for the candidates
            cand = _build_on(self.pool, key, self.stream, self.prepare, self.events)
        del self.pending[key]
        self.pool.kept[key] = cand
        if self.progress is not None:
            self.progress(self.total - len(self.pending), self.total)

    def take(self, key) -> Candidates:
        self.build(key)
        _wait_for(self.events, key, self.device)
        return self.pool.kept[key]

    def close(self) -> None:
        _release(self.device)


def _device(pool: CandidatePool) -> torch.device:
    """Where the pool's model (its first parameter) is: where its candidates are built."""
    weight = next(iter(pool.model.parameters()), None)
    return weight.device if weight is not None else torch.device("cpu")


def _build_on(pool: CandidatePool, key, stream, prepare, events: dict) -> Candidates:
    """Group `key`'s candidates built on `stream` (None: the current one), `prepare` run on them,
    and, on a stream, an event recorded after them in ``events[key]``."""
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        cand = pool._build(key)
        if prepare is not None:
            prepare(cand)
        if stream is not None:
            events[key] = stream.record_event()
    return cand


def _wait_for(events: dict, key, device: torch.device) -> None:
    """Make the current stream wait for group `key`'s build event, once (none: nothing)."""
    ev = events.pop(key, None)
    if ev is not None:
        torch.cuda.current_stream(device).wait_event(ev)


def _release(device: torch.device) -> None:
    """Before candidates made on a stream of their own can be dropped: they go back to that
    stream's memory pool, so nothing queued on another stream may still read them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
