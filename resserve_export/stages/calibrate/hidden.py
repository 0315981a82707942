"""Where the layer-by-layer calibration keeps the hidden states between layers: on the device
while they fit, else in CPU memory (pinned for a GPU), else in a spill directory, one file per
batch (``RESSERVE_HIDDEN_STORE`` forces ``device``, ``cpu`` or ``disk``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from resserve_export.core.errors import UserError

HIDDEN_ENV = "RESSERVE_HIDDEN_STORE"  # device | cpu | disk: where hidden states live (default: by free memory)


class HiddenStore:
    """Per-batch hidden states on the device, in CPU memory or in files under `spill`."""

    def __init__(self, where: str, spill: Path | None, device: torch.device):
        self.where, self.spill, self.device = where, spill, device
        self.items: list = []
        if where == "disk" and spill is not None:
            spill.mkdir(parents=True, exist_ok=True)

    @classmethod
    def of_files(cls, paths: list[Path], device: torch.device) -> HiddenStore:
        """Hidden states saved one file per batch (a resume point's), read on demand."""
        h = cls("disk", None, device)
        h.items = list(paths)
        return h

    def put(self, i: int, h: torch.Tensor) -> None:
        if self.where == "device":
            v = h.to(self.device)
        elif self.where == "cpu":
            v = h.to("cpu")
            if self.device.type == "cuda":
                v = v.pin_memory()
        else:
            path = self.spill / f"h{i}.pt"
            torch.save(h.to("cpu"), path)
            v = path
        if i < len(self.items):
            self.items[i] = v
        else:
            self.items.append(v)

    def get(self, i: int) -> torch.Tensor:
        return self.host(i).to(self.device, non_blocking=True)

    def host(self, i: int) -> torch.Tensor:
        """Batch `i` where it is kept (on the device, in CPU memory, or read from its file),
        without a copy to the device: what a resume point writes."""
        v = self.items[i]
        return torch.load(v, weights_only=True) if self.where == "disk" else v

    def all_host(self):
        """Every batch, one at a time (`host`)."""
        return (self.host(i) for i in range(len(self.items)))


def choose_store(total_bytes: int, device: torch.device) -> str:
    """Where `total_bytes` of hidden states go (``device``, ``cpu`` or ``disk``): ``RESSERVE_HIDDEN_STORE``
    if set, else the device (or CPU memory) while they take less than half of what is free."""
    forced = os.environ.get(HIDDEN_ENV, "").strip().lower()
    if forced:
        if forced not in ("device", "cpu", "disk"):
            raise UserError(f"{HIDDEN_ENV}={forced!r}: use device, cpu or disk")
        return forced
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if total_bytes < 0.5 * free:
            return "device"
    return ("device" if device.type == "cpu" else "cpu") if total_bytes < 0.5 * available_memory() else "disk"


def available_memory() -> int:
    """Bytes of host memory available now (MemAvailable)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


__all__ = ["HIDDEN_ENV", "HiddenStore", "choose_store", "available_memory"]
