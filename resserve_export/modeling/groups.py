"""Which linears are quantized, and which share an input (fused at serving time).

q/k/v of one attention block and gate/up of one MLP read the same activation: they form one
decision group with one ratio, one mask and (NVFP4) one input_scale / weight_scale_2
(docs/formats.md, "NVFP4" and "Channel selection and masks").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from resserve_export.core.names import natural_key
from resserve_export.modeling.families import is_exact

# Never quantized (docs/formats.md, "Checkpoint directory"): embeddings, lm_head, norms, routers.
_SKIP = re.compile(r"(^|\.)(lm_head|embed_tokens|wte|wpe|embed_out|gate|router|shared_expert_gate|mlp\.gate|block_sparse_moe\.gate)$")
# Gated DeltaNet's input projections (Qwen3.5) read one input and are fused by vLLM into
# in_proj_qkvz and in_proj_ba.
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a"))
_EXPERTS = re.compile(r"\.experts\.")


@dataclass(frozen=True)
class Group:
    """A decision unit: member module paths sharing one input, and their common in_features."""

    modules: tuple[str, ...]
    in_features: int
    out_features: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.modules[0] if len(self.modules) == 1 else "+".join(self.modules)

    @property
    def weight_count(self) -> int:
        return sum(n * self.in_features for n in self.out_features)


def is_quantized(name: str) -> bool:
    """Whether linear `name` is quantized: not an embedding, ``lm_head`` or router, and not in a
    part of the model that stays exact (a vision tower, a projector: `families.is_exact`)."""
    return _SKIP.search(name) is None and not is_exact(name)


def expert_modules(names: list[str]) -> list[str]:
    """Names inside MoE experts (``….experts.…``; not supported yet)."""
    return [n for n in names if _EXPERTS.search(n)]


def group_linears(linears: dict[str, tuple[int, int]]) -> list[Group]:
    """Group ``{module: (out_features, in_features)}`` into decision groups, in module order.

    Fusable siblings (q/k/v, gate/up) form one group only when they read inputs of the same
    width; otherwise each width gets its own group. Every quantized linear ends in exactly one
    group: none is ever dropped.
    """
    names = [n for n in linears if is_quantized(n)]
    taken: set[str] = set()
    groups: list[Group] = []
    for n in names:
        if n in taken:
            continue
        parent, _, leaf = n.rpartition(".")
        members = [n]
        for fused in _FUSED:
            if leaf in fused:
                siblings = [f"{parent}.{x}" if parent else x for x in fused]
                members = [m for m in siblings if m in linears and m not in taken and linears[m][1] == linears[n][1]]
                break
        taken.update(members)
        groups.append(Group(tuple(members), linears[n][1], tuple(linears[m][0] for m in members)))
    return groups


def linears_of(model) -> dict[str, tuple[int, int]]:
    """``{module path: (out_features, in_features)}`` for every nn.Linear of a model."""

    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def linears_from_shapes(shapes: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, int]]:
    """The same from safetensors headers: every 2-D ``<module>.weight`` (no model needed)."""
    out = {}
    for k, (_, shape) in shapes.items():
        if k.endswith(".weight") and len(shape) == 2:
            mod = k[: -len(".weight")]
            if "norm" in mod.rsplit(".", 1)[-1] or "embed" in mod:
                continue
            out[mod] = (shape[0], shape[1])
    return out


def exact_linears(shapes: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """The linears of the checkpoint headers `shapes` in parts of the model that stay exact (a
    vision tower, a projector), in canonical order: named in the quantization config's ignore
    list so that no loader quantizes them. Every 2-D weight there but norms: a tower's embedders
    and patch projections are linears a loader may quantize too (vLLM's Gemma 4 quantizes
    ``embed_vision.embedding_projection`` under compressed-tensors unless it is ignored)."""
    mods = (k[: -len(".weight")] for k, (_, s) in shapes.items() if k.endswith(".weight") and len(s) == 2)
    return sorted((m for m in mods if is_exact(m) and "norm" not in m.rsplit(".", 1)[-1]), key=natural_key)
