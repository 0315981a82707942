"""Block-local channel selection and uint8 masks (docs/formats.md, "Channel selection and masks").

Channels are grouped in 8s; ratio ρ selects k = 8ρ channels in every group by salience
(float32 ``mean_abs``), ties going to the lower channel index. Mask byte g has bit b set when
channel 8g+b is selected.
"""

from __future__ import annotations

import torch

from resserve_export.formats.constants import PARTIAL_RATIOS, RATIOS, SELECTION_GROUP

_BITS = (1 << torch.arange(SELECTION_GROUP, dtype=torch.int32)).to(torch.int32)


def check_ratio(ratio: float) -> float:
    ratio = float(ratio)
    if ratio not in RATIOS:
        raise ValueError(f"ratio {ratio} is not allowed, choose one of {list(RATIOS)}")
    return ratio


def mode_of(ratio: float) -> str:
    """``plain`` (ρ = 0), ``k_ext`` (partial ρ) or ``full`` (ρ = 1)."""
    ratio = check_ratio(ratio)
    return "plain" if ratio == 0 else ("full" if ratio == 1 else "k_ext")


def select_mask(mean_abs: torch.Tensor, ratio: float) -> torch.Tensor:
    """uint8 mask ``[K/8]`` of the top-k salient channels of every group of 8."""
    ratio = check_ratio(ratio)
    K = mean_abs.shape[-1]
    if K % SELECTION_GROUP:
        raise ValueError(f"in_features {K} is not a multiple of the selection group {SELECTION_GROUP}")
    groups = mean_abs.detach().float().cpu().reshape(-1, SELECTION_GROUP)
    if ratio == 0:
        return torch.zeros(groups.shape[0], dtype=torch.uint8)
    if ratio == 1:
        return torch.full((groups.shape[0],), 0xFF, dtype=torch.uint8)
    k = int(round(ratio * SELECTION_GROUP))
    # A stable descending sort keeps equal values in index order: ties go to the lower channel.
    order = torch.sort(groups, dim=-1, descending=True, stable=True).indices[:, :k]
    return _BITS[order].sum(dim=-1).to(torch.uint8)


def select_masks(mean_abs: torch.Tensor, ratios) -> dict[float, torch.Tensor]:
    """``{ρ: select_mask(mean_abs, ρ)}`` from one stable sort: the top-k of every group are the
    first k of its sorted order, so the selections are nested and the masks the same bits."""
    ratios = [check_ratio(r) for r in ratios]
    K = mean_abs.shape[-1]
    if K % SELECTION_GROUP:
        raise ValueError(f"in_features {K} is not a multiple of the selection group {SELECTION_GROUP}")
    partial = [r for r in ratios if r not in (0, 1)]
    order = None
    if partial:
        groups = mean_abs.detach().float().cpu().reshape(-1, SELECTION_GROUP)
        order = torch.sort(groups, dim=-1, descending=True, stable=True).indices
    out = {}
    for r in ratios:
        if r in (0, 1):
            out[r] = select_mask(mean_abs, r)
        else:
            out[r] = _BITS[order[:, : int(round(r * SELECTION_GROUP))]].sum(dim=-1).to(torch.uint8)
    return out


def mask_to_bool(mask: torch.Tensor) -> torch.Tensor:
    """uint8 ``[K/8]`` -> bool ``[K]``."""
    return ((mask.to(torch.int32).unsqueeze(-1) & _BITS.to(mask.device)) != 0).reshape(-1)


def mask_to_indices(mask: torch.Tensor) -> torch.Tensor:
    """Selected channel indices in ascending order (the compaction order of docs/formats.md)."""
    return torch.nonzero(mask_to_bool(mask), as_tuple=False).reshape(-1)


def bool_to_mask(selected: torch.Tensor) -> torch.Tensor:
    """bool ``[K]`` -> uint8 mask ``[K/8]``."""
    g = selected.reshape(-1, SELECTION_GROUP).to(torch.int32)
    return (g * _BITS.to(selected.device)).sum(dim=-1).to(torch.uint8)


__all__ = ["PARTIAL_RATIOS", "check_ratio", "mode_of", "select_mask", "select_masks", "mask_to_bool", "mask_to_indices", "bool_to_mask"]
