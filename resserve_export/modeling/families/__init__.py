"""Model families: one adapter per family (`Family`), each in its own module, and what the rest
of the package asks of them: the family of a ``config.json``, whether a tensor stays exact, and
the refusal of a checkpoint this tool cannot quantize completely, before any work.

A new family is one module here (a `Family` named ``FAMILY``) added to `FAMILIES`, plus its test
under ``tests/modeling/families/``. Families that need nothing beyond the generic decoder rules
(every 2-D linear of the decoder layers quantized; embeddings, ``lm_head``, norms and routers
exact) are covered by `text.FAMILY`.
"""

from __future__ import annotations

import re

from resserve_export.core.errors import UserError
from resserve_export.core.names import natural_key
from resserve_export.modeling.families import (
    gemma3,
    gemma4,
    gpt_oss,
    llama4,
    mistral3,
    nemotron_h,
    qwen3_5,
    qwen_vl,
    text,
)
from resserve_export.modeling.families.base import Family
from resserve_export.storage.safetensors import Part

FAMILIES: tuple[Family, ...] = (
    text.FAMILY,
    gemma3.FAMILY,
    gemma4.FAMILY,
    qwen_vl.QWEN2_VL,
    qwen_vl.QWEN3_VL,
    qwen_vl.QWEN3_VL_MOE,
    mistral3.FAMILY,
    qwen3_5.FAMILY,
    qwen3_5.HYBRID_TEXT,
    nemotron_h.FAMILY,
    llama4.FAMILY,
    gpt_oss.FAMILY,
)

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
# Tensors under these prefixes are never quantized, in any family: the names are those of
# vision towers, projectors and audio towers, which no decoder-only model uses.
_EXACT = re.compile("^(?:" + "|".join(sorted({p for f in FAMILIES for p in f.exact})) + r")(?:\.|$)")
_KEPT = [(re.compile(p), what) for f in FAMILIES for p, what in f.kept]
_REFUSED = [(re.compile(p), why) for f in FAMILIES for p, why in f.refused]


def family_of(config: dict) -> Family:
    """The adapter of a model's ``config.json`` (the generic decoder family when none is named)."""
    return _BY_TYPE.get(config.get("model_type"), text.FAMILY)


def is_exact(name: str) -> bool:
    """Whether tensor or module `name` lies in a part of a model that is never quantized (a vision
    tower, a multimodal projector)."""
    return _EXACT.match(name) is not None


def kept_as(name: str) -> str | None:
    """What tensor `name` is when it is a known non-linear parameter copied exactly (a
    convolution, a state-space parameter), else None."""
    return next((what for p, what in _KEPT if p.search(name)), None)


def check_tensors(shapes: dict[str, tuple[str, tuple[int, ...]]], doing: str = "done") -> None:
    """Refuse, before any work, a checkpoint holding a tensor this tool cannot handle completely,
    with one line naming the tensor and what it is: a layout a family adapter refuses (experts
    fused on disk), or a tensor of 3 or more dimensions that is neither in an exact part of the
    model nor a known convolution."""
    for name in sorted(shapes, key=natural_key):
        why = next((w for p, w in _REFUSED if p.search(name)), None)
        if why is not None:
            shape = list(shapes[name][1])
            raise UserError(f"{name} is a {len(shape)}-D tensor {shape}: {why}; nothing was {doing}")
    for name in sorted(shapes, key=natural_key):
        shape = tuple(shapes[name][1])
        if len(shape) < 3 or is_exact(name) or kept_as(name) is not None:
            continue
        raise UserError(
            f"{name} is a {len(shape)}-D tensor {list(shape)} of a layout this tool does not know (not a linear weight, "
            f"a known convolution or a per-expert projection): this model is not supported; nothing was {doing}"
        )


_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<leaf>[A-Za-z0-9_]+)$")


def expert_parts(config: dict, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Part]:
    """``{per-expert weight name: the part of a fused tensor it is}`` for a family that stores its
    experts fused on disk (`Family.experts_on_disk`), else empty.

    Two orientations are found on disk: input-major, as hub checkpoints store them
    (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``), and output-major, as
    transformers 5 holds and saves them (``[E, 2I, H]``, ``[E, H, I]``). The pair's shapes tell
    which (both cannot fit one pair), so no size is taken from the configuration. Either way
    expert E reads as ``….experts.E.gate_proj.weight`` ``[I, H]``, ``up_proj`` and ``down_proj``
    ``[H, I]``. A pair that fits neither is left as it is (and refused by `check_tensors`)."""
    fused = family_of(config).experts_on_disk
    if fused is None:
        return {}
    out: dict[str, Part] = {}
    for name in sorted(shapes, key=natural_key):
        m = _FUSED.match(name)
        if m is None or m["leaf"] != fused.gate_up:
            continue
        down = f"{m['prefix']}.{fused.down}"
        gu, dn = tuple(shapes[name][1]), tuple(shapes.get(down, ("", ()))[1])
        if len(gu) != 3 or len(dn) != 3 or gu[0] != dn[0]:
            continue
        E, (a, b), (c, d) = gu[0], gu[1:], dn[1:]
        if a == 2 * d and b == c:
            transposed, H, I = False, b, d
        elif b == 2 * c and a == d:
            transposed, H, I = True, a, c
        else:
            continue
        gate, up = ((0, 2 * I, 2), (1, 2 * I, 2)) if fused.interleaved else ((0, I, 1), (I, 2 * I, 1))
        for e in range(E):
            at = f"{m['prefix']}.{e}"
            out[f"{at}.gate_proj.weight"] = Part(name, e, *gate, transposed=transposed)
            out[f"{at}.up_proj.weight"] = Part(name, e, *up, transposed=transposed)
            out[f"{at}.down_proj.weight"] = Part(down, e, 0, H, transposed=transposed)
    return out


def unfused_shapes(config: dict, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`shapes` as the tool reads the checkpoint: experts fused on disk replaced, in the fused
    tensor's place, by one 2-D weight per expert (`expert_parts`)."""
    parts = expert_parts(config, shapes)
    if not parts:
        return shapes
    by_source: dict[str, list[str]] = {}
    for n, p in parts.items():
        by_source.setdefault(p.source, []).append(n)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, (dtype, shape) in shapes.items():
        if name not in by_source:
            out[name] = (dtype, shape)
            continue
        for n in by_source[name]:
            out[n] = (dtype, parts[n].shape(tuple(shape[1:])))
    return out


def check_format(config: dict, fmt: str, doing: str = "done") -> None:
    """Refuse, before any work, an output format stock vLLM cannot load for this family."""
    f = family_of(config)
    why = dict(f.refused_formats).get(fmt)
    if why is not None:
        raise UserError(f"--format {fmt} is not written for {f.name.split(' (')[0]}: {why}; nothing was {doing}")


def check_weight_algo(config: dict, algo: str, doing: str = "done") -> None:
    """Refuse, before any work, ``--weight-algo awq`` for a family whose layers it cannot fold into exactly."""
    f = family_of(config)
    if "awq" in algo.split("+") and f.refused_awq:
        raise UserError(f"--weight-algo {algo}: {f.refused_awq}; nothing was {doing}")


def check_experts_layout(config: dict, layout: str, doing: str = "done") -> None:
    """Refuse, before any work, ``--experts-layout hub`` for a model that is not gpt-oss: the
    hub's MXFP4 expert layout (`storage.hub_experts`) is gpt-oss's."""
    f = family_of(config)
    if layout == "hub" and f is not gpt_oss.FAMILY:
        raise UserError(
            f"--experts-layout hub is the layout of gpt-oss's hub checkpoints, and this model is {config.get('model_type')!r}: "
            f"leave out --experts-layout hub; nothing was {doing}"
        )


def hub_quantization_config() -> dict:
    """config.json's ``quantization_config`` of gpt-oss's hub MXFP4 checkpoints (without our
    ``resserve`` section), as `pack --experts-layout hub` writes it."""
    return {k: list(v) if isinstance(v, list) else v for k, v in gpt_oss.HUB_MXFP4_CONFIG.items()}


def writes_fused_experts(config: dict) -> bool:
    """Whether the family's experts are written fused per expert (`storage.fused_experts`)."""
    fused = family_of(config).experts_on_disk
    return fused is not None and fused.written_fused


def adapt(model, config: dict) -> None:
    """Give the loaded `model` the form the tool's hooks expect, where its family needs one
    (`Family.adapt`; in place)."""
    f = family_of(config).adapt
    if f is not None:
        f(model)


def check_loadable(config: dict, arch: str | None) -> bool:
    """Whether `arch` is the wrapper class of a vision-language family (loaded with its own class)."""
    return family_of(config).wrapper and bool(arch) and arch.endswith("ForConditionalGeneration")


def has_adapter(config: dict) -> bool:
    """Whether a family adapter (not the generic decoder rules) covers this model: it is then
    loaded under its checkpoint's tensor names (`modeling.view`). Generic decoders keep the module
    tree transformers builds (their experts are mapped by `modeling.experts`)."""
    return family_of(config) is not text.FAMILY


__all__ = ["FAMILIES", "Family", "family_of", "check_format", "check_weight_algo", "check_experts_layout", "hub_quantization_config", "writes_fused_experts", "expert_parts", "unfused_shapes", "adapt", "is_exact", "kept_as", "check_tensors", "check_loadable", "has_adapter"]
