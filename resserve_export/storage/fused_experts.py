"""Experts written fused per expert, as vLLM's gpt-oss loader reads quantized experts.

vLLM's gpt-oss model loads quantized experts one expert at a time under the names of its fused
parameters (``<…>.experts.E.w13_<suffix>``, ``<…>.experts.E.w2_<suffix>``) and, for
compressed-tensors MXFP4, through its unquantized path, which transposes what it reads. So each
expert's gate and up base tensors (``[I, X]`` each, X the packed or scale width along K) are
written as one tensor ``w13_<suffix>`` ``[X, 2·I]`` whose column 2i is gate row i and column
2i+1 up row i (the interleaving of its ``swigluoai`` activation), and down's as ``w2_<suffix>``
``[X, H]``. The sidecar keeps the per-linear names (``E.gate_proj.resserve_mask`` …).

`merged_specs` gives the written tensors' specs (the layout), `FusedWriter` produces them from
the per-linear tensors `pack` makes, and `read_parts` presents them per linear again (the
reader)."""

from __future__ import annotations

import re

import torch

from resserve_export.storage.safetensors import Part, TensorSpec

_MEMBER = re.compile(r"^(?P<expert>.+\.experts\.\d+)\.(?P<leaf>gate_proj|up_proj|down_proj)\.(?P<suffix>weight\w*)$")
_WRITTEN = re.compile(r"^(?P<expert>.+\.experts\.\d+)\.(?P<fused>w13|w2)_(?P<suffix>weight\w*)$")


def merged_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """One decision group's base tensor specs as written: an expert's gate and up merged into
    ``w13_<suffix>``, its down into ``w2_<suffix>``, each transposed; anything else unchanged."""
    out = []
    for s in specs:
        m = _MEMBER.match(s.name)
        if m is None:
            out.append(s)
            continue
        n, x = s.shape
        if m["leaf"] == "gate_proj":
            out.append(TensorSpec(f"{m['expert']}.w13_{m['suffix']}", s.dtype, (x, 2 * n)))
        elif m["leaf"] == "down_proj":
            out.append(TensorSpec(f"{m['expert']}.w2_{m['suffix']}", s.dtype, (x, n)))
    return out


class FusedWriter:
    """Writes through `writer` what `merged_specs` lists, from per-linear writes: an expert's
    gate tensor is held until its up tensor of the same suffix arrives."""

    def __init__(self, writer):
        self.writer = writer
        self.held: dict[str, torch.Tensor] = {}

    def write(self, name: str, t: torch.Tensor) -> None:
        m = _MEMBER.match(name)
        if m is None:
            self.writer.write(name, t)
            return
        key = f"{m['expert']}.{m['suffix']}"
        if m["leaf"] == "gate_proj":
            self.held[key] = t
        elif m["leaf"] == "up_proj":
            gate = self.held.pop(key)
            self.writer.write(f"{m['expert']}.w13_{m['suffix']}", torch.stack([gate, t], dim=1).reshape(2 * t.shape[0], -1).t().contiguous())
        else:
            self.writer.write(f"{m['expert']}.w2_{m['suffix']}", t.t().contiguous())


def read_parts(shapes: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Part]:
    """``{per-linear tensor name: its part of a written fused tensor}`` for a checkpoint's headers
    `shapes` (empty when the experts are written per linear)."""
    out = {}
    for name, (_, shape) in shapes.items():
        m = _WRITTEN.match(name)
        if m is None or len(shape) != 2:
            continue
        e, s = m["expert"], m["suffix"]
        if m["fused"] == "w13":
            out[f"{e}.gate_proj.{s}"] = Part(name, 0, 0, shape[1], 2, transposed=True)
            out[f"{e}.up_proj.{s}"] = Part(name, 0, 1, shape[1], 2, transposed=True)
        else:
            out[f"{e}.down_proj.{s}"] = Part(name, 0, 0, shape[1], transposed=True)
    return out


__all__ = ["merged_specs", "FusedWriter", "read_parts"]
