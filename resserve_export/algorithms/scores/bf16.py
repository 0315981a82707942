"""The bf16 GEMM layouts of the grad scores' fast path, and which backend prepares their operands.

The FP4 operands are exact in bfloat16 once the NVFP4 tensor scales are factored out
(`emulate.exact_operand`), so every candidate product runs as a bf16 GEMM with FP32
accumulation. With c = α_x·α_w (1 for MXFP4), D_ρ = Y_q(ρ) − Y = D_0 + E_ρ where
  E_ρ = c · (R̂'_ρ @ Ŵ'_ρᵀ)   the residue products (bf16 outputs: they are differences)
and D_0 = Y_q(plain) − Y, the plain error, comes in one of two layouts:

- fused (any device): D_0 = c · ([X̂' | X | X] @ [Ŵ' | −H | −L]ᵀ), one GEMM of inner width
  3K whose bf16 output rounds the small difference, not the outputs; H + L = W/c to ~2⁻¹⁷
  (H = bf16(W/c), L = bf16(W/c − H); L is dropped when it is zero, e.g. MXFP4 on a bf16
  model). X must be exact in bf16 (a bf16 model).
- split (CUDA, where a bf16 GEMM can write FP32: `mm_f32`): P = X̂'Ŵ'ᵀ and Y = X Wᵀ with
  the module's own weight, both with FP32 outputs, and D_0 = c·P − Y formed in FP32 inside
  the reduction (`grad_sq_sums_split`): two width-K products instead of one of width 3K, no
  [X̂' | X | X] copy, no H/L weights (≈ 4 bytes per weight less), and D_0 rounded at 2⁻²⁴
  of Y instead of 2⁻⁹ of D_0. X only has to be exact in the module's dtype (bf16 or fp16).

Either way Y is X Wᵀ with FP32 accumulation: more accurate than the module's bf16 output,
which the FP32 path subtracts. All paths are checked against a float64 oracle in
tests/test_scores.py.

This module holds the layout-level pieces that do not depend on one group: the compiled
operand preparation (`_prepare_body`, from the format's own block functions through
`registry`), the choice of preparation backend (`prepare_backend`: compiled graph, fused CUDA
kernel or eager reference), the squared-sum reductions, the FP32-output GEMM and the choice of
layout, and whether a group's split-layout GEMMs and sums run as one call of the CUDA extension
(`native_group_sums`, `checked_group_sums`: on CUDA the scoring is bound by its host launches,
and the Python path makes a GEMM and a Triton launch per member). The per-group weights and the
calls in order are `candidates.Candidates`' (its ``*_fast`` methods).
"""

from __future__ import annotations

import functools
import os

import torch

from resserve_export.algorithms.scores import fused
from resserve_export.algorithms.scores.device import mm_f32_native
from resserve_export.core.compiling import compile_or_eager
from resserve_export.formats import registry
from resserve_export.formats.mxfp4 import ScaleRounding


def _prepare_body(x, alpha, idxs, *, fmt: str, rounding: ScaleRounding, modes: tuple, widths: tuple, twice: bool):
    """The bf16 operands of `Candidates.prepare_fast` from the format core's block functions (the
    quantizer's own bodies), as one graph for `torch.compile`."""
    f = registry.get(fmt)
    b = f.block
    M, K = x.shape

    def quant(t):
        return f.quantize_blocks(t.reshape(-1, b), alpha, rounding)

    def deq(codes, scales, a):
        return f.dequantize_blocks(codes, scales, a)

    one = torch.ones_like(alpha)
    codes, scales = quant(x)
    res = x.float() - deq(codes, scales, alpha).reshape(M, K)
    xb = x.to(torch.bfloat16)
    a0 = torch.cat([deq(codes, scales, one).reshape(M, K).to(torch.bfloat16), xb] + ([xb] if twice else []), dim=1)
    ops = []
    it = iter(idxs)
    for mode, width in zip(modes, widths):
        if mode == "full":
            src = res
        else:
            sel = res.index_select(1, next(it))
            src = torch.cat([sel, sel.new_zeros((M, width - sel.shape[1]))], dim=1)
        c, s = quant(src)
        ops.append(deq(c, s, one).reshape(M, width).to(torch.bfloat16))
    return a0, ops


def prepare_backend(x: torch.Tensor) -> str:
    """`prepare_fast`'s ``auto``: the compiled graph on CPU for inputs of ≥ 2^16 elements, the fused
    CUDA kernel for bf16/fp16 CUDA inputs when it can run, else the eager reference;
    ``RESSERVE_BACKEND=reference`` forces the reference."""
    if os.environ.get("RESSERVE_BACKEND", "") == "reference":
        return "reference"
    if x.device.type == "cpu":
        return "compiled" if x.numel() >= (1 << 16) else "reference"
    if x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous():
        from resserve_export.algorithms import kernel

        if kernel.KERNEL_AVAILABLE:
            return "kernel"
    return "reference"


# Rows per compiled `prepare_fast` call (static shapes vectorise ~2.5x better than dynamic ones).
PREPARE_ROWS = 128


@functools.lru_cache(maxsize=None)
def compiled_prepare(fmt: str, rounding: ScaleRounding, modes: tuple, widths: tuple, twice: bool):
    body = functools.partial(_prepare_body, fmt=fmt, rounding=rounding, modes=modes, widths=widths, twice=twice)
    return compile_or_eager(body, dynamic=False, fullgraph=True)


def _sq_sums_eager(g: torch.Tensor, d0: torch.Tensor, *es: torch.Tensor) -> torch.Tensor:
    """[Σ (g·d0)², Σ (g·(d0 + e))² for each e] in FP32, one pass over flat inputs."""
    g = g.float()
    gd = g * d0.float()
    out = [torch.sum(gd * gd)]
    for e in es:
        t = gd + g * e.float()
        out.append(torch.sum(t * t))
    return torch.stack(out)


def _sq_sums_split_eager(g: torch.Tensor, p: torch.Tensor, y: torch.Tensor, c: torch.Tensor, *es: torch.Tensor) -> torch.Tensor:
    """`_sq_sums_eager` for the split layout: d0 = c·p − y and each e scaled by c, all in FP32
    (p, y: the FP32 products X̂'Ŵ'ᵀ and X Wᵀ; c: α_x·α_w as a 0-d FP32 tensor)."""
    g = g.float()
    gd = g * (c * p - y)
    out = [torch.sum(gd * gd)]
    for e in es:
        t = gd + g * (c * e.float())
        out.append(torch.sum(t * t))
    return torch.stack(out)


def _fused(fn, device: torch.device):
    """`fn` fused by `torch.compile` on CPU (one read of each operand instead of a pass per
    elementwise op), eager elsewhere or with ``RESSERVE_BACKEND=reference``. Not on CUDA: there
    the compiled reduction (a Triton kernel summing ``[M, N]`` to a few scalars) took 1.5 ms a call,
    57% of the GPU time of a scoring batch on the H200, and eager was faster overall
    (bench/results/plan.md); CUDA takes the hand-written kernel of `fused` instead, and this eager
    function only without Triton. A compiler failure falls back to eager (`compiling.compile_or_eager`)."""
    if device.type != "cpu" or os.environ.get("RESSERVE_BACKEND", "") == "reference":
        return fn
    return _compiled_reduction(fn, device.type)


@functools.lru_cache(maxsize=None)
def _compiled_reduction(fn, device_type: str):
    return compile_or_eager(fn, dynamic=True, fullgraph=True)


def grad_sq_sums(g: torch.Tensor, d0: torch.Tensor, *es: torch.Tensor) -> torch.Tensor:
    """`_sq_sums_eager`: one Triton kernel on CUDA (`fused.sq_sums`), compiled on CPU (see `_fused`)."""
    if fused.available(g.device) and len(es) <= fused._MAX_ES:
        return fused.sq_sums(g, d0, None, None, *es)
    return _fused(_sq_sums_eager, g.device)(g, d0, *es)


def grad_sq_sums_split(g, p, y, c, *es, out: torch.Tensor | None = None) -> torch.Tensor:
    """`_sq_sums_split_eager` in float64: one kernel on CUDA (`fused.sq_sums`), compiled on CPU
    (see `_fused`). `out`: a float64 total the sums are added to, and returned (a group's over
    its members: on CUDA inside the reduction's own launches)."""
    if fused.available(g.device) and len(es) <= fused._MAX_ES:
        return fused.sq_sums(g, p, y, c, *es, out=out)
    s = _fused(_sq_sums_split_eager, g.device)(g, p, y, c, *es).double()
    return s if out is None else out.add_(s)


# Per CUDA device: True once the extension's group sums agreed with this module's on a group,
# False once they disagreed or could not run (build or launch error); absent: not tried yet.
_GROUP_SUMS: dict = {}
# How far the extension's group sums may be from the Triton path's on the first group: the two sum
# the same FP32 terms in other orders (≈ 1e-6 relative apart); an indexing or layout error is O(1).
GROUP_SUMS_RTOL = 1e-4


def native_group_sums(device: torch.device) -> bool:
    """Whether a group's stacked split-layout sums go through the CUDA extension's one call
    (`kernel.group_sums_split`: the group's GEMMs and reductions without a Python call per
    member): on CUDA where the extension can build, unless ``RESSERVE_GROUP_SUMS=0`` or its first
    group on `device` failed (`checked_group_sums`)."""
    if device.type != "cuda" or os.environ.get("RESSERVE_GROUP_SUMS", "") == "0" or not fused.ext.KERNEL_AVAILABLE:
        return False
    return _GROUP_SUMS.get(device, True)


def checked_group_sums(args: tuple, python) -> torch.Tensor:
    """`kernel.group_sums_split(*args)`, the first time on a device also compared with
    ``python()`` (the same sums through `grad_sq_sums_split`): a result further than
    `GROUP_SUMS_RTOL` from it, or an extension that fails to build or launch, turns the extension
    off for that device, and that call returns ``python()``."""
    device = args[1].device
    try:
        out = fused.ext.group_sums_split(*args)
    except Exception:  # noqa: BLE001 - any build or launch failure: the Python path's sums instead
        _GROUP_SUMS[device] = False
        return python()
    if device not in _GROUP_SUMS:
        want = python()
        ok = out.shape == want.shape and bool(((out - want).abs() <= GROUP_SUMS_RTOL * want.abs()).all())
        _GROUP_SUMS[device] = ok
        if not ok:
            return want
    return out


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ bᵀ with FP32 sums and an FP32 output. bf16/fp16 operands: one native GEMM writing FP32
    where `mm_f32_native`, else the same products (exact in FP32) in an FP32 GEMM (slow; only the
    split layout's tests take it on a CPU)."""
    if a.dtype == b.dtype and mm_f32_native(a.device, a.dtype):
        return torch.mm(a, b.T, out_dtype=torch.float32)
    return a.float() @ b.float().T


def split_base(x: torch.Tensor, linears) -> bool:
    """Whether `prepare_fast` takes the split layout for input x of these linears: on CUDA, for
    bf16/fp16 inputs of linears of the same dtype, where the GEMMs can write FP32 (`mm_f32_native`).
    Elsewhere the fused layout: one GEMM of width 3K with a bf16 output (on CPUs an FP32 output
    would have to come from an FP32 GEMM, ~4x a bf16 one)."""
    return (
        x.device.type == "cuda"
        and all(lin.weight.dtype == x.dtype for lin in linears)
        and mm_f32_native(x.device, x.dtype)
    )


def base_operand(xhat: torch.Tensor, x: torch.Tensor, split: bool, twice: bool):
    """The base operand of `prepare_fast`: ``(X̂', X)`` (split) or ``[X̂' | X | X]`` / ``[X̂' | X]``."""
    if split:
        return xhat, x
    xb = x.to(torch.bfloat16)
    return torch.cat([xhat, xb] + ([xb] if twice else []), dim=1)
