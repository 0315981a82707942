"""One finiteness check for many statistics tensors."""

from __future__ import annotations

import torch


def finite_each(tensors: list) -> list[bool]:
    """Whether each tensor holds only finite values, with one device-to-host copy per device
    (not one per tensor: a sync per layer would stall a GPU forward's launch queue)."""

    by_device: dict = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out = [True] * len(tensors)
    for idx in by_device.values():
        flat = torch.isfinite(torch.cat([tensors[i].reshape(-1) for i in idx])).tolist()
        pos = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = all(flat[pos : pos + n])
            pos += n
    return out
