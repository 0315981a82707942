"""Device choice, once for every command: the checked ``--device`` value and the torch device it
resolves to."""

from __future__ import annotations

import torch

from resserve_export.core.errors import UserError


def parse_device(device: str) -> str:
    """Check a ``--device`` value: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""

    d = str(device).strip().lower()
    if d in ("auto", "cpu"):
        return d
    if d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: no CUDA GPU is visible; use --device cpu or auto")
        if ":" in d and int(d[5:]) >= torch.cuda.device_count():
            raise UserError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        return d
    raise UserError(f"unknown --device {device!r}: use auto, cpu, cuda or cuda:N")


def resolve_device(device: str) -> torch.device:
    """The torch device of a ``--device`` value (checked by `parse_device`): ``auto`` is the first
    CUDA GPU when one is visible, else the CPU."""
    d = parse_device(device)
    if d == "auto":
        d = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(d)
