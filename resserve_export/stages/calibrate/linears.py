"""The quantized linears calibrate sees and their decision groups, from the checkpoint headers
(before any load) or from a loaded or weightless model."""

from __future__ import annotations

import torch

from resserve_export.core.errors import UserError
from resserve_export.core.names import natural_key
from resserve_export.formats.constants import MXFP4_BLOCK
from resserve_export.modeling.experts import fused_modules
from resserve_export.modeling.groups import Group, expert_modules, group_linears, is_quantized, linears_from_shapes

# Every quantized input dimension must hold whole MXFP4 blocks (32), which also covers NVFP4 (16).
IN_FEATURES_MULTIPLE = MXFP4_BLOCK


def check_in_features(linears: dict[str, tuple[int, int]]) -> None:
    """Every quantized linear needs in_features divisible by 32 (whole FP4 blocks and selection groups)."""
    for name in sorted(linears, key=natural_key):
        k = linears[name][1]
        if is_quantized(name) and k % IN_FEATURES_MULTIPLE:
            raise UserError(
                f"linear {name} has in_features {k}, not a multiple of {IN_FEATURES_MULTIPLE}: "
                "FP4 blocks cannot tile it; this model is not supported"
            )


def quantized_linears(shapes) -> dict[str, tuple[int, int]]:
    """``{name: (out_features, in_features)}`` of the quantized linears of the checkpoint headers `shapes`."""
    return {k: v for k, v in linears_from_shapes(shapes).items() if is_quantized(k)}


def model_groups_of(net, model_dir, blocks=()) -> list[Group]:
    """The decision groups of a loaded (or weightless) model's ``nn.Linear`` modules, and of the
    experts of `blocks` (`experts.ExpertBlock`) under their checkpoint names, each block's at the
    place of its fused module."""
    fused = {}
    if blocks:
        fused = {id(mod): b for b, mod in zip(blocks, fused_modules(net, list(blocks)).values())}
    linears = {}
    for n, m in net.named_modules():
        if isinstance(m, torch.nn.Linear):
            linears[n] = (m.out_features, m.in_features)
        elif id(m) in fused:
            linears.update(fused[id(m)].linears())
    check_in_features(linears)
    experts = expert_modules([n for n in linears if is_quantized(n)])
    if experts and not blocks:
        raise UserError(f"mixture-of-experts linears (e.g. {experts[0]}) are not supported yet: calibrate a dense model")
    groups = group_linears(linears)
    if not groups:
        raise UserError(f"{model_dir} has no linear layers to quantize")
    return groups
