"""What a model family adapter declares: how the checkpoint is loaded, which of its tensors stay
exact, and what is refused (and why) before any work."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# Why a tensor holding every expert of a layer is refused (`Family.refused`).
FUSED_EXPERTS = (
    "every expert of its layer in one tensor (experts fused on disk), in a layout this tool does not read (it reads "
    "gate_up_proj [E, H, 2I] / down_proj [E, I, H] pairs, or their transposes)"
)


@dataclass(frozen=True)
class FusedOnDisk:
    """How a family stores every expert of a layer in one tensor on disk: ``<…>.experts.<gate_up>``
    ``[E, hidden, 2·intermediate]`` (gate columns first, then up; or alternating when
    `interleaved`) and ``<…>.experts.<down>`` ``[E, intermediate, hidden]`` — each expert's
    projections stored input-major, the transpose of a linear's weight. The tool reads them as one
    linear weight per expert (``<…>.experts.E.gate_proj.weight`` ``[I, H]``, ``up_proj``,
    ``down_proj``) and writes them so, as quantized checkpoints of these families are stored."""

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    interleaved: bool = False
    # Written as the family's vLLM loader reads quantized experts: per expert, gate and up in one
    # tensor, interleaved and transposed (`storage.fused_experts`), not one tensor per linear.
    written_fused: bool = False


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
    refused before any work with that reason. `experts_on_disk`: how the family stores experts
    fused on disk (`FusedOnDisk`), when it does. `adapt`: called on the loaded model (in place)
    where its modules need another form for the tool's hooks (Llama 4's experts). `disk_names`:
    ``(prefix, hub prefix)`` pairs where the family's hub checkpoints name tensors otherwise than
    transformers writes them (`size` counts the hub names' header bytes). `refused_formats`:
    ``(format, why)`` for output formats stock vLLM cannot load for the family. `refused_awq`: why
    ``--weight-algo awq`` cannot fold exactly into the family's layers (empty: it can).
    """

    name: str
    model_types: tuple[str, ...]
    quantized: str = "every decoder linear (attention, MLP)"
    wrapper: bool = False
    exact: tuple[str, ...] = ()
    kept: tuple[tuple[str, str], ...] = ()
    refused: tuple[tuple[str, str], ...] = ()
    experts_on_disk: FusedOnDisk | None = None
    adapt: Callable[[object], None] | None = None
    disk_names: tuple[tuple[str, str], ...] = ()
    refused_formats: tuple[tuple[str, str], ...] = ()
    refused_awq: str = ""
    test: str = ""

    def __post_init__(self):
        for p in self.exact:
            re.compile(p)
        for p, _ in (*self.kept, *self.refused):
            re.compile(p)
