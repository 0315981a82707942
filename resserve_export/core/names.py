"""Names used across the package, each defined once: the canonical tensor order, the key of a
ratio in score and plan files, the decoder-layer index in a module path, and the suffixes of the
sidecar tensors (docs/formats.md, "Checkpoint directory")."""

from __future__ import annotations

import re


def natural_key(name: str) -> tuple:
    """Sort key that orders ``layers.2`` before ``layers.10``: the canonical tensor order."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[.]", name))


def ratio_key(ratio: float) -> str:
    """The key of a ratio in scores.json: "0", "0.125", "0.25", "0.5", "1"."""
    return f"{float(ratio):g}"


# Sidecar tensors of a compensated linear (docs/formats.md, "Checkpoint directory").
MASK_SUFFIX = "resserve_mask"  # uint8 [K/8], bit b of byte g: channel 8g+b selected
EXT_WEIGHT_SUFFIX = "resserve_weight"  # the extension's FP4 codes [N, K_E/2]
EXT_SCALE_SUFFIX = "resserve_weight_scale"  # the extension's block scales
SIDECAR_SUFFIXES = (MASK_SUFFIX, EXT_WEIGHT_SUFFIX, EXT_SCALE_SUFFIX)

# The decoder layer of a module path: the number after ``layers.`` (``model.layers.3.mlp`` -> 3).
DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder-layer index in module or tensor path `name`, None outside the decoder layers."""
    m = DECODER_LAYER.search(name + ".")
    return int(m.group(1)) if m else None
