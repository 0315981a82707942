"""gpt-oss's MXFP4 experts in the hub's layout (``pack --experts-layout hub``), the one FP4 layout
whose expert biases stock vLLM 0.32 loads (its ``gpt_oss_mxfp4`` method).

Every layer's experts are stored as four tensors, all E experts at once, as openai/gpt-oss-20b
ships them: ``<…>.experts.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]`` (row 2i: gate unit
i, row 2i+1: up unit i, each row H/32 blocks of 32 E2M1 codes, two a byte, element 2j in the low
nibble), ``gate_up_proj_scales`` uint8 E8M0 ``[E, 2I, H/32]``, ``down_proj_blocks``
``[E, H, I/32, 16]`` and ``down_proj_scales`` ``[E, H, I/32]``. They hold exactly the codes and
scales `pack` makes per linear (``E.gate_proj.weight_packed`` ``[I, H/2]``, ``weight_scale``
``[I, H/32]``, …), only rearranged.

`hub_specs` gives a layer's written specs (the layout), `HubWriter` produces them from the
per-linear tensors `pack` makes, holding one layer's experts until its last one arrives, and
`read_parts` presents them per linear again (the reader)."""

from __future__ import annotations

import re

import torch

from resserve_export.storage.safetensors import Part, TensorSpec

LAYOUTS = ("per-expert", "hub")  # `pack --experts-layout`: how a family's experts are written
HUB = "hub"

_MEMBER = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<leaf>gate_proj|up_proj|down_proj)\.(?P<suffix>weight_packed|weight_scale)$")
_STORED = re.compile(r"^(?P<experts>.+\.experts)\.(?P<fused>gate_up_proj|down_proj)_(?P<kind>blocks|scales)$")
_KIND = {"weight_packed": "blocks", "weight_scale": "scales"}
_SUFFIX = {v: k for k, v in _KIND.items()}
_BLOCK = 32  # MXFP4 elements per scale: 16 bytes of codes


def expert_linear(module: str) -> tuple[str, int, str] | None:
    """(``<…>.experts``, expert index, leaf) of an expert's gate / up / down linear, else None."""
    m = re.match(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<leaf>gate_proj|up_proj|down_proj)$", module)
    return (m["experts"], int(m["e"]), m["leaf"]) if m else None


def hub_specs(experts: str, E: int, I: int, H: int) -> list[TensorSpec]:
    """The four tensors a layer's `E` experts (intermediate size `I`, hidden size `H`) are written
    as, in write order."""
    return [
        TensorSpec(f"{experts}.gate_up_proj_blocks", "U8", (E, 2 * I, H // _BLOCK, _BLOCK // 2)),
        TensorSpec(f"{experts}.gate_up_proj_scales", "U8", (E, 2 * I, H // _BLOCK)),
        TensorSpec(f"{experts}.down_proj_blocks", "U8", (E, H, I // _BLOCK, _BLOCK // 2)),
        TensorSpec(f"{experts}.down_proj_scales", "U8", (E, H, I // _BLOCK)),
    ]


def per_layer(modules) -> dict[str, int]:
    """``{<…>.experts: number of experts}`` of the expert linears among `modules`."""
    seen: dict[str, set[int]] = {}
    for m in modules:
        p = expert_linear(m)
        if p is not None:
            seen.setdefault(p[0], set()).add(p[1])
    return {k: len(v) for k, v in seen.items()}


class HubWriter:
    """Collects the per-linear MXFP4 tensors of every layer's experts (`pack_group`'s writes) and
    writes a layer's `hub_specs` tensors once all of its experts are there: at most one layer's
    quantized experts are held. `experts`: `per_layer` of the quantized linears. Call `into`
    with the writer of the group being packed; a write of any other tensor goes straight to it."""

    def __init__(self, experts: dict[str, int]):
        self.expected = {k: 6 * E for k, E in experts.items()}  # gate, up, down: codes and scales each
        self.held: dict[str, dict[tuple[int, str, str], torch.Tensor]] = {}

    def into(self, writer) -> _Into:
        return _Into(self, writer)

    def write(self, name: str, t: torch.Tensor, writer) -> None:
        m = _MEMBER.match(name)
        if m is None or m["experts"] not in self.expected:
            writer.write(name, t)
            return
        layer = self.held.setdefault(m["experts"], {})
        layer[(int(m["e"]), m["leaf"], m["suffix"])] = t
        if len(layer) < self.expected[m["experts"]]:
            return
        del self.held[m["experts"]]
        E = self.expected[m["experts"]] // 6
        for fused, kind, t in _stack(layer, E):
            writer.write(f"{m['experts']}.{fused}_{kind}", t)

    def finish(self) -> None:
        """Fail if a layer's experts did not all arrive (a layout error, not a user error)."""
        if self.held:
            raise RuntimeError(f"experts left unwritten: {', '.join(sorted(self.held))}")


class _Into:
    def __init__(self, hub: HubWriter, writer):
        self.hub, self.writer = hub, writer

    def write(self, name: str, t: torch.Tensor) -> None:
        self.hub.write(name, t, self.writer)


def _stack(layer: dict[tuple[int, str, str], torch.Tensor], E: int) -> list[tuple[str, str, torch.Tensor]]:
    """(fused, kind, tensor) in `hub_specs` order from one layer's per-linear tensors."""
    out = []
    for fused in ("gate_up_proj", "down_proj"):
        for kind in ("blocks", "scales"):
            suffix = _SUFFIX[kind]
            if fused == "gate_up_proj":
                # rows interleaved: gate unit i, then up unit i
                each = [torch.stack([layer[(e, "gate_proj", suffix)], layer[(e, "up_proj", suffix)]], dim=1).flatten(0, 1) for e in range(E)]
            else:
                each = [layer[(e, "down_proj", suffix)] for e in range(E)]
            t = torch.stack(each)
            if kind == "blocks":
                t = t.reshape(E, t.shape[1], -1, _BLOCK // 2)
            out.append((fused, kind, t.contiguous()))
    return out


def read_parts(shapes: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Part]:
    """``{per-linear tensor name: its part of a stored hub tensor}`` for a checkpoint's headers
    `shapes` (blocks are cut as ``[rows, K/2]``: each row's blocks are contiguous)."""
    out = {}
    for name, (_, shape) in shapes.items():
        m = _STORED.match(name)
        if m is None or len(shape) not in (3, 4):
            continue
        suffix = _SUFFIX[m["kind"]]
        for e in range(shape[0]):
            at = f"{m['experts']}.{e}"
            if m["fused"] == "gate_up_proj":
                out[f"{at}.gate_proj.{suffix}"] = Part(name, e, 0, shape[1], 2)
                out[f"{at}.up_proj.{suffix}"] = Part(name, e, 1, shape[1], 2)
            else:
                out[f"{at}.down_proj.{suffix}"] = Part(name, e, 0, shape[1])
    return out


__all__ = ["LAYOUTS", "HUB", "expert_linear", "hub_specs", "per_layer", "HubWriter", "read_parts"]
