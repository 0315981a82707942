"""The grad scores' host thread: the groups' candidate products launched from a thread of their
own, so that the model's backward pass keeps launching its kernels meanwhile. Opt-in
(``RESSERVE_SCORE_THREAD=1``): measured on an H100 it was no faster than scoring inside the hooks
from prebuilt candidates and 4% faster from scratch (bench/results/plan.md), since the scoring is
now close to bound by the GPU's own work.

On a GPU the bf16 grad scores are bound by the host: a scoring run spent about twice as much CPU
time launching kernels as the GPU spent running them (bench/results/plan.md). Scored inside the
gradient hooks, every group stops the autograd engine's thread for the whole of its launches, and
the GPU idles whenever the backward's next kernels wait for them. `ScoringThread` takes the
scoring out of the hooks: a hook hands the group's captured input and gradients over and returns,
and one thread launches the groups' work in the order they were handed over. The same operations
run on the same stream in the same order per group, so the scores are the same bits (tests compare
the two on the CPU, and on a GPU where there is one); only their interleaving with the backward's
kernels changes. With a `pool.CandidatePool`, each group's candidates are built on the thread when
it is first scored, while the model's passes run, instead of all of them before the first batch.

Most of a launch's host time is spent outside the GIL (PyTorch releases it inside an operator), so
the autograd thread's C++ launches and this thread's run side by side. On a CPU the operators are
the work itself and the thread only adds contention (bench/plan.py measures both settings).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable

import torch

# Groups handed over and not yet scored, at most: each holds its input and gradients, so a
# thread that falls behind makes the backward wait instead of holding every layer's tensors.
DEPTH = 8


class ScoringThread:
    """Runs submitted jobs one after the other on a thread of its own, on `device` with the stream
    that was current when it was made. `drain` waits for every job submitted so far and raises
    the first error of one (the jobs after a failed one are skipped); `close` drains and ends
    the thread (``raise_error=False``: on a path that is already failing, without raising)."""

    def __init__(self, device: torch.device, depth: int = DEPTH):
        self.device = torch.device(device)
        self.stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.threads = torch.get_num_threads()
        self._jobs: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="resserve-scores", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # A set-up that fails is the first error: the jobs are then taken and skipped, so that a
        # caller blocked on a full queue or in `drain` gets it instead of waiting forever.
        try:
            enter_thread(self.device, self.threads, self.stream)
        except BaseException as e:
            self._error = e
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    job()
            except BaseException as e:  # handed to the caller by `drain`
                self._error = e
            finally:
                self._jobs.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        if self._error is not None:
            self.drain()
        if not self._thread.is_alive():
            raise RuntimeError("the scoring thread has ended")
        self._jobs.put(job)

    def drain(self) -> None:
        self._jobs.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self, raise_error: bool = True) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        err, self._error = self._error, None
        if err is not None and raise_error:
            raise err


def enter_thread(device: torch.device, threads: int, stream=None) -> None:
    """Set up a thread of ours as a gradient hook runs: no autograd recording (the backward pass
    turns it off), the caller's CPU thread count, and on a GPU its device (and `stream`, if given;
    else the device's default stream). Used by `ScoringThread` and `pool.CandidatePool.build_ahead`."""
    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if stream is not None:
            torch.cuda.set_stream(stream)


def wanted() -> bool:
    """Whether the grad scores take a `ScoringThread`: ``RESSERVE_SCORE_THREAD=1`` (on any device;
    off by default, see the module docstring)."""
    return os.environ.get("RESSERVE_SCORE_THREAD", "") == "1"
