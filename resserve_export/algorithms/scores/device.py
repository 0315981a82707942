"""What this machine's GEMMs can do, for the bf16 path of the grad scores.

Two facts, each probed once: whether bf16 GEMMs are fast here (`fast_bf16`: any CUDA GPU, or a
CPU whose ``/proc/cpuinfo`` lists AVX512-BF16 or AMX), which `precision.resolve_precision` reads
to pick ``auto``; and whether a bf16/fp16 GEMM can write its FP32 sums (`mm_f32_native`: CUDA
with torch ≥ 2.8), which decides the layout of the base product (`bf16.split_base`) and so the
memory the candidates take (`precision.bytes_per_weight_of`). They live here, apart from the
arithmetic that uses them, so the platform probing has one home.
"""

from __future__ import annotations

import functools

import torch


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 GEMMs are fast on this device: any CUDA GPU (the bf16 path is ~2.6x faster
    than the FP32 emulation on an H200, bench/results/plan.md), or a CPU with AVX512-BF16 or AMX,
    where a bf16 GEMM is ~4x an FP32 one."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.lru_cache(maxsize=None)
def mm_f32_native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for `dtype` operands on `device`:
    a bf16/fp16 GEMM (FP32 accumulation) that writes its FP32 sums instead of rounding them, on
    CUDA with torch ≥ 2.8. Probed once per (device, dtype) on a tiny product."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        a = torch.full((2, 16), 1.5, dtype=dtype, device=device)
        out = torch.mm(a, a.T, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return out.dtype == torch.float32 and bool((out == 36.0).all())
