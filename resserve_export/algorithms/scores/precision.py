"""The arithmetic of the grad scores' candidate products, and what it costs in memory.

``fp32`` runs the emulated linear's own FP32 products; ``bf16`` the exact FP4 operands in bf16
GEMMs (`bf16`, `Candidates.prepare_fast`); ``auto`` picks from the device facts of `device`
(`resolve_precision`). The precision and the device also fix the layout the candidates build,
hence their bytes per weight (`bytes_per_weight_of`), which sizes the memory-bounded
`pool.CandidatePool`: both answers come from the same facts, so they live together.
"""

from __future__ import annotations

import torch

from resserve_export.algorithms.scores.device import fast_bf16, mm_f32_native

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(precision: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """``fp32`` or ``bf16`` for the grad scores' candidate products. ``auto`` is bf16 where bf16
    GEMMs are fast (`fast_bf16`: CUDA GPUs, CPUs with AVX512-BF16/AMX) for a model whose
    activations are exact operands of its products there: a bf16 model, or on a GPU an fp16 model
    when the split layout runs (its X Wᵀ keeps X in fp16; the fused layout would round X to bf16).
    Else fp32 (e.g. an FP32 model: its activations are not exact in bf16)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown score precision {precision!r}, available: {list(PRECISIONS)}")
    if precision == "auto":
        device = torch.device(device)
        if not fast_bf16(device):
            return "fp32"
        exact = dtype == torch.bfloat16 or (dtype == torch.float16 and mm_f32_native(device, dtype))
        return "bf16" if exact else "fp32"
    return precision


# Bytes the candidates of one weight element take: the FP4 tensors (≈ 1.1) and, for the fp32
# path, the FP32 dequantized base and extensions (≈ 4 + 3.5); the bf16 path never makes those
# (`emulate.QuantizedWeight` dequantizes on first use) and holds its bf16 operands instead: ≈ 8 in
# the fused layout ([Ŵ' | −H | −L] and the extensions), ≈ 3.75 in the split one (Ŵ' and the
# extensions; W is the module's own). Checked against the tensors' sizes in tests/test_scores.py.
_BYTES_PER_WEIGHT = {"fp32": 8.5, "bf16": 9.0, "bf16-split": 5.0}


def bytes_per_weight_of(method: str, precision: str, device: torch.device, dtype: torch.dtype) -> float:
    """`_BYTES_PER_WEIGHT` of the layout the scores will build on `device` for a `dtype` model."""
    if method != "grad" or precision != "bf16":
        return _BYTES_PER_WEIGHT["fp32"]
    split = device.type == "cuda" and mm_f32_native(device, dtype)
    return _BYTES_PER_WEIGHT["bf16-split" if split else "bf16"]
