"""Data-parallel calibration under ``torchrun`` (``torch.distributed``: NCCL on GPUs, gloo on CPUs).

Every rank builds the same samples and batches (same seed), takes a contiguous share of the
batches (`Ranks.share`), and collects on its own device with no communication until the end.
Then the ranks agree that all of them succeeded (`Ranks.agree`: one all-reduce; a rank that
failed prints its own one-line error, the others a line naming it, and none writes anything),
and rank 0 gathers what the others measured and writes the output.

Bit-identical to one process. A one-process run adds each batch's float32 partial sums of |x|
into a float64 accumulator, batch after batch; float64 addition is not associative, so partial
sums per rank added at the end would differ in the last bits. So each rank keeps every batch's
partial sums (`StatsCollector(keep_batches=True)`, float32 vectors), and rank 0 replays the
additions in global batch order: rank 0's batches, then rank 1's, … — exactly the one-process
order. amax (and the KV cache's amax) reduce by max, which is exact in any order; token counts
are integers. Grad scores likewise: every per-group float64 addition of each rank is recorded
and replayed in rank order (`scores.grad.ScoreSums.replay`; per group, the additions of one rank
are in its batch order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from resserve_export.core.errors import UserError


def world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


@dataclass
class Ranks:
    rank: int
    size: int
    local_rank: int
    backend: str

    @classmethod
    def start(cls, device: str) -> Ranks:
        """Join the process group torchrun set up; the device this rank computes on is
        ``cuda:LOCAL_RANK`` when GPUs are visible and `device` is not ``cpu``."""

        local = int(os.environ.get("LOCAL_RANK", "0"))
        gpu = device != "cpu" and torch.cuda.is_available()
        backend = "nccl" if gpu else "gloo"
        if not dist.is_initialized():
            if gpu:
                torch.cuda.set_device(local)
            dist.init_process_group(backend)
        return cls(dist.get_rank(), dist.get_world_size(), local, backend)

    def device(self, device: str) -> str:
        return f"cuda:{self.local_rank}" if self.backend == "nccl" else "cpu"

    def share(self, items: list) -> list:
        """This rank's contiguous share of `items` (sizes differ by at most one)."""
        n, k = len(items), self.size
        start = self.rank * (n // k) + min(self.rank, n % k)
        stop = start + n // k + (1 if self.rank < n % k else 0)
        return items[start:stop]

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank failed: its own error where it failed, a one-line
        `UserError` naming the first failed rank elsewhere."""

        flag = torch.tensor([self.size if error is None else self.rank], dtype=torch.int64)
        if self.backend == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        first = int(flag.item())
        if error is not None:
            raise error
        if first < self.size:
            raise UserError(f"rank {first} of {self.size} failed (its message above): nothing was written")

    def gather(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""

        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:

        if dist.is_initialized():
            dist.destroy_process_group()


def merge_stats(parts: list[dict], groups) -> dict[str, dict]:
    """`StatsCollector.result()` of one process from the ranks' `StatsCollector.parts()`, in
    rank order (see the module docstring)."""
    tokens = sum(p["tokens"] for p in parts)
    if tokens == 0:
        raise UserError("no valid tokens were seen: the samples are empty")
    out = {}
    for gi, g in enumerate(groups):
        acc = None
        amax = None
        for p in parts:
            for s in p["sums"][gi]:
                acc = s.to(torch.float64) if acc is None else acc + s
            a = p["amax"][gi]
            if a is not None:
                amax = a if amax is None else torch.maximum(amax, a)
        if acc is None:
            raise UserError(f"linear {g.modules[0]} never ran in the forward pass: the model does not use it; it cannot be calibrated")
        mean_abs = (acc / tokens).to(torch.float32).contiguous()
        amax = amax.to(torch.float32).reshape(())
        for m in g.modules:
            out[m] = {"mean_abs": mean_abs.clone(), "amax": amax.clone()}
    return out


def merge_kv(parts: list[dict | None]) -> dict | None:
    """The ranks' KV-cache statistics combined by max (None if any rank has none)."""
    if any(p is None for p in parts):
        return None
    out = {}
    for name in parts[0]:
        out[name] = {k: torch.stack([p[name][k] for p in parts]).amax() for k in ("k_amax", "v_amax")}
    return out


__all__ = ["Ranks", "world_size", "merge_stats", "merge_kv"]
