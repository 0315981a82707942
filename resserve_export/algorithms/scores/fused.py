"""Kernels of the grad scores' bf16 path on CUDA: one pass where eager PyTorch makes many.

Two memory-bound steps dominated the bf16 path's GPU time beyond its GEMMs (bench/results/plan.md):

- the squared-sum reduction (`sq_sums`): eager, ``Σ (g ⊙ (c·P − Y + c·E_ρ))²`` for the plain
  ratio and each compensated one is ~25 elementwise kernels per member, each writing an FP32
  ``[M, N]`` temporary (≈ 270 bytes of traffic per output element); here one kernel reads g, P,
  Y and every E_ρ once (≈ 18 bytes) and writes one FP32 partial sum per program and ratio, which
  a second, tiny reduction adds in float64 (fixed partition, so the result does not depend on
  the launch's scheduling);
- the bf16 operands of the quantized activations (`exact_bf16`): `emulate.exact_operand`
  unpacks, widens the codes to int64, gathers, scales and rounds in five to six passes
  (≈ 40 bytes per element); here one kernel reads the packed codes and the block scales and
  writes the bf16 values (≈ 2.6 bytes). The values are the same bits: the E2M1 value times the
  block's FP32 scale factor (the format's own `dequantize_blocks` of a block of ones), a product
  exact in FP32 and in bf16.

The operands go through the project's CUDA extension by default where it builds (the same
products in a C++ call, whose host cost is a fifth of a Triton launch's; ``RESSERVE_EXACT_OPERAND=triton``
keeps this module's kernel), and the candidates then prepare a group's activation in one call
of it (`kernel.prepare_operands`).

`available(device)`: Triton is importable and the tensors are on CUDA, unless
``RESSERVE_BACKEND=reference``. The callers (`bf16`, `candidates`) fall back to the eager
functions otherwise. ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (how their logic is
checked without a GPU).
"""

from __future__ import annotations

import functools
import os

import torch

from resserve_export.algorithms import kernel as ext
from resserve_export.core.compiling import kernel_available, triton_modules
from resserve_export.formats.fp4 import e2m1_table

# Elements per program of the reduction: BLOCK lanes × _ITERS steps. 16K elements keep ≥ 1000
# programs in flight for a [4096, 4096] output and the partial sums small.
_BLOCK = 1024
_ITERS = 16
# Output columns per program of the operand kernel.
_COLS = 1024


@functools.lru_cache(maxsize=None)
def _triton():
    mods = triton_modules()
    return None if mods is None else (*mods, _build(*mods))


def available(device: torch.device) -> bool:
    """Whether the kernels run for tensors on `device` (see the module docstring)."""
    return kernel_available(device, _triton, interpret=True)


def _build(triton, tl):
    @triton.jit
    def sq_sums_kernel(g_ptr, a_ptr, b_ptr, c_ptr, e0_ptr, e1_ptr, e2_ptr, e3_ptr, out_ptr, n, cols, ld_g, ld_a, ld_b, ld_e,
                       SPLIT: tl.constexpr, NE: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * (BLOCK * ITERS)
        lanes = tl.arange(0, BLOCK)
        c = tl.load(c_ptr)
        acc0 = tl.zeros([BLOCK], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK], dtype=tl.float32)
        acc4 = tl.zeros([BLOCK], dtype=tl.float32)
        for it in range(ITERS):
            idx = start + it * BLOCK + lanes
            m = idx < n
            # Element idx of the row-major [n / cols, cols] view; each input has its row stride.
            row = idx // cols
            col = idx - row * cols
            g = tl.load(g_ptr + (row * ld_g + col), mask=m, other=0.0).to(tl.float32)
            if SPLIT:
                p = tl.load(a_ptr + (row * ld_a + col), mask=m, other=0.0).to(tl.float32)
                y = tl.load(b_ptr + (row * ld_b + col), mask=m, other=0.0).to(tl.float32)
                gd = g * (c * p - y)
            else:
                gd = g * tl.load(a_ptr + (row * ld_a + col), mask=m, other=0.0).to(tl.float32)
            acc0 += gd * gd
            eo = row * ld_e + col
            if NE > 0:
                e = tl.load(e0_ptr + eo, mask=m, other=0.0).to(tl.float32)
                t = gd + g * (c * e)
                acc1 += t * t
            if NE > 1:
                e = tl.load(e1_ptr + eo, mask=m, other=0.0).to(tl.float32)
                t = gd + g * (c * e)
                acc2 += t * t
            if NE > 2:
                e = tl.load(e2_ptr + eo, mask=m, other=0.0).to(tl.float32)
                t = gd + g * (c * e)
                acc3 += t * t
            if NE > 3:
                e = tl.load(e3_ptr + eo, mask=m, other=0.0).to(tl.float32)
                t = gd + g * (c * e)
                acc4 += t * t
        row = out_ptr + pid * (NE + 1)
        tl.store(row, tl.sum(acc0, axis=0))
        if NE > 0:
            tl.store(row + 1, tl.sum(acc1, axis=0))
        if NE > 1:
            tl.store(row + 2, tl.sum(acc2, axis=0))
        if NE > 2:
            tl.store(row + 3, tl.sum(acc3, axis=0))
        if NE > 3:
            tl.store(row + 4, tl.sum(acc4, axis=0))

    @triton.jit
    def exact_kernel(codes_ptr, scales_ptr, sf_lut_ptr, lut_ptr, out_ptr, width, codes_stride, scales_stride,
                     BLOCK_Q: tl.constexpr, COLS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * COLS + tl.arange(0, COLS)
        m = col < width
        byte = tl.load(codes_ptr + row * codes_stride + col // 2, mask=m, other=0).to(tl.int32)
        code = tl.where(col % 2 == 0, byte & 15, byte >> 4)
        v = tl.load(lut_ptr + code, mask=m, other=0.0)
        sbyte = tl.load(scales_ptr + row * scales_stride + col // BLOCK_Q, mask=m, other=0).to(tl.int32)
        s = tl.load(sf_lut_ptr + sbyte, mask=m, other=0.0)
        tl.store(out_ptr + row * width + col, (v * s).to(tl.bfloat16), mask=m)

    return sq_sums_kernel, exact_kernel


_MAX_ES = 4


def _rows(t: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """`t` as ``shape`` with unit column stride (a view where it already is one) and its row stride."""
    t = t.reshape(shape) if t.dim() != 2 else t
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0)


def sq_sums(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, c: torch.Tensor, *es: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``[1 + len(es)]``: the split layout's ``[Σ (g(c·a − b))², Σ (g(c·a − b + c·e))² …]`` (b
    given: a = P, b = Y) or the fused one's ``[Σ (g·a)², Σ (g(a + e))² …]`` (b None: a = D_0), as
    `bf16._sq_sums_split_eager` / `bf16._sq_sums_eager` compute them (same FP32 products, summed in
    another order: the scores within 2e-4 relative; 9.1e-5 measured on an H200, bench/results/plan.md).
    Inputs of one shape, flat or 2-D; 2-D ones may be column blocks of wider tensors (row-strided
    views, read in place: a member's columns of a group's stacked products). At most four e.
    `out`: a float64 ``[1 + len(es)]`` the sums are added to (a group's total over its members,
    without an addition of its own), and returned."""
    if len(es) > _MAX_ES:
        raise ValueError(f"at most {_MAX_ES} residue products per reduction, got {len(es)}")
    split = b is not None
    if any(t.numel() != g.numel() for t in [a] + ([b] if split else []) + list(es)):
        raise ValueError("the reduction's inputs differ in length")
    _, _, (kernel, _) = _triton()
    shape = tuple(g.shape) if g.dim() == 2 else (1, g.numel())
    g, ld_g = _rows(g, shape)
    a, ld_a = _rows(a, shape)
    b, ld_b = _rows(b, shape) if split else (a, ld_a)
    es = [_rows(e, shape) for e in es]
    if len({ld for _, ld in es}) > 1:  # one row stride for every e
        es = [(e.contiguous(), shape[1]) for e, _ in es]
    ld_e = es[0][1] if es else 0
    es = [e for e, _ in es]
    n = g.numel()
    c = c.to(device=g.device, dtype=torch.float32).reshape(1) if split else _ones(g.device)
    programs = max(1, -(-n // (_BLOCK * _ITERS)))
    part = torch.empty((programs, 1 + len(es)), dtype=torch.float32, device=g.device)
    pad = es + [g] * (_MAX_ES - len(es))
    kernel[(programs,)](
        g, a, b, c, *pad, part, n, shape[1], ld_g, ld_a, ld_b, ld_e,
        SPLIT=split, NE=len(es), BLOCK=_BLOCK, ITERS=_ITERS, num_warps=8,
    )
    total = part.sum(dim=0, dtype=torch.float64)
    return total if out is None else out.add_(total)


_ONES: dict = {}


def _ones(device: torch.device) -> torch.Tensor:
    """An FP32 ``[1]`` one on `device`, made once (the fused layout's c)."""
    t = _ONES.get(device)
    if t is None:
        t = _ONES[device] = torch.ones(1, device=device)
    return t


_SCALE_LUTS: dict = {}


def scale_factors(fmt, device: torch.device) -> torch.Tensor:
    """FP32 ``[256]``: the factor each block-scale byte stands for, from the format's own decoder
    (`dequantize_blocks` of a block of ones with α = 1), made once per format and device. A
    block's factor depends on its scale byte alone, so a lookup gives the decoder's bits."""
    key = (fmt.name, device)
    lut = _SCALE_LUTS.get(key)
    if lut is None:
        raw = fmt.as_scales(torch.arange(256, dtype=torch.uint8, device=device)).reshape(256, 1)
        ones = torch.full((256, 1, 1), 0x22, dtype=torch.uint8, device=device)  # E2M1 1.0 in both nibbles
        one = torch.ones((), dtype=torch.float32, device=device)
        lut = _SCALE_LUTS[key] = fmt.dequantize_blocks(ones, raw, one if fmt.has_tensor_scale else None)[:, 0, 0].contiguous()
    return lut


_BACKENDS = ("auto", "extension", "triton")


def _backend(backend: str, device: torch.device) -> str:
    """``extension`` or ``triton`` for `backend` (one of `_BACKENDS`): ``auto`` takes the extension
    for CUDA tensors where `kernel.KERNEL_AVAILABLE`, unless ``RESSERVE_EXACT_OPERAND=triton``."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}, available: {list(_BACKENDS)}")
    if backend == "auto":
        on_ext = ext.KERNEL_AVAILABLE and device.type == "cuda" and os.environ.get("RESSERVE_EXACT_OPERAND", "") != "triton"
        return "extension" if on_ext else "triton"
    return backend


def extension_operands(device: torch.device) -> bool:
    """Whether the operands on `device` come from the CUDA extension (`_backend`'s ``auto``): then
    a group's whole preparation of an activation is one C++ call (`kernel.prepare_operands`)."""
    return _backend("auto", device) == "extension"


def exact_bf16(q, fmt, backend: str = "auto") -> torch.Tensor:
    """`emulate.exact_operand(q)` (bf16, α factored out), bit for bit, in one kernel: q an
    `FP4Tensor` of 2-D codes ``[M, width/2]`` (row-strided views allowed, e.g. a column slice of
    the fused kernel's ``[X̂ | R̂_S]``), `fmt` its `registry.Format`. The block factors come from
    `scale_factors` (the format's decoder, once), the E2M1 values from `fp4.e2m1_table`.

    `backend`: ``extension`` launches the project's CUDA extension (`kernel.exact_bf16`; a C++
    call costs the host ≈ 13 µs where this Triton kernel's launch cost ≈ 70 µs on an H100 host,
    and the grad scores make four of these per group and batch: bench/results/plan.md),
    ``triton`` this module's kernel; ``auto`` the extension for CUDA tensors where
    `kernel.KERNEL_AVAILABLE`, else (or with ``RESSERVE_EXACT_OPERAND=triton``) this module's
    kernel. Both give the same bits (their GPU test compares them as integers)."""
    backend = _backend(backend, q.codes.device)
    codes, scales = q.codes, q.scales
    if codes.dim() != 2 or codes.stride(-1) != 1:
        codes = codes.reshape(-1, codes.shape[-1]).contiguous()
    M, width = codes.shape[0], 2 * codes.shape[1]
    scales = scales.reshape(M, width // fmt.block).view(torch.uint8)
    if scales.stride(-1) != 1:
        scales = scales.contiguous()
    if M == 0:
        return torch.empty((0, width), dtype=torch.bfloat16, device=codes.device)
    factors = scale_factors(fmt, codes.device)
    if backend == "extension":
        return ext.exact_bf16(codes, scales, factors, fmt.block)
    _, _, (_, kernel) = _triton()
    out = torch.empty((M, width), dtype=torch.bfloat16, device=codes.device)
    kernel[(M, -(-width // _COLS))](
        codes, scales, factors, e2m1_table(codes.device), out, width, codes.stride(0), scales.stride(0),
        BLOCK_Q=fmt.block, COLS=_COLS, num_warps=4,
    )
    return out
