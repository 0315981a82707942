"""What a model family adapter declares: how the checkpoint is loaded, which of its tensors stay
exact, and what is refused (and why) before any work."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Why a tensor holding every expert of a layer is refused (`Family.refused`).
FUSED_EXPERTS = (
    "every expert of its layer in one tensor (experts fused on disk, as Llama 4, gpt-oss and Qwen3-VL-MoE store them); "
    "quantizing experts stored fused is not supported yet"
)


@dataclass(frozen=True)
class Family:
    """One model family as this tool handles it.

    `model_types`: the ``model_type`` values of ``config.json`` it covers (the top-level one).
    `wrapper`: the architecture wraps a language model (a vision-language model): it is loaded
    with its own class, not ``AutoModelForCausalLM``, and only the language model's decoder
    linears are quantized. `exact`: checkpoint-name prefixes (regular expressions, matched at the
    start of a tensor name) whose tensors are copied byte for byte: vision towers, multimodal
    projectors. `kept`: ``(pattern, what it is)`` for tensors that are not linears and are copied
    exactly (convolutions, state-space parameters), matched anywhere in the name. `refused`:
    ``(pattern, why)`` for tensors this tool cannot quantize yet; a checkpoint holding one is
    refused before any work with that reason.
    """

    name: str
    model_types: tuple[str, ...]
    quantized: str = "every decoder linear (attention, MLP)"
    wrapper: bool = False
    exact: tuple[str, ...] = ()
    kept: tuple[tuple[str, str], ...] = ()
    refused: tuple[tuple[str, str], ...] = ()
    test: str = ""

    def __post_init__(self):
        for p in self.exact:
            re.compile(p)
        for p, _ in (*self.kept, *self.refused):
            re.compile(p)
