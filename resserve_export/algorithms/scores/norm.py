"""The grad scores' RMSNorms: the eager chain's bits with a fraction of its memory traffic (the
default), or forward and backward in one Triton kernel each (opt-in).

Transformers' RMSNorms compute in FP32 as a chain of eager ops (widen, square, mean, rsqrt,
scale, narrow, weight), and their backward replays that chain through autograd with FP32 copies
of the hidden states at every step. The grad scores run a forward and a backward of the whole
model per batch; by a count of bytes these norms (two per layer on the hidden states, and Qwen3's
per-head q/k norms) are the largest share of the model's own non-GEMM memory traffic there
(bench/results/plan.md). `fused_norms` swaps every RMSNorm of a model during those passes, as
`mode` says:

- ``exact`` (the default, `_ExactNorm`): the chain's elementwise steps in Triton kernels that
  round where the eager ops round, and its two row reductions (the forward's mean of x², the
  backward's row sum into 1/rms's gradient) through PyTorch's own ops on tensors of the layout
  autograd gives them, so they sum in PyTorch's order. Output and input gradient are the eager
  ones bit for bit, and the scores with them (up to the model's own nondeterministic backward on a
  GPU). About 32 bytes a hidden-state element for forward and backward together instead of ≈ 120, and
  only x and one FP32 number a row kept for the backward. That is checked, not assumed (`_Checks`):
  on a class's first call its output and input gradient under a random output gradient, and later
  the output for every new width and dtype and the gradient for every new layout of the output's
  gradient, each against the module's own forward and autograd. Any difference sends the class
  back to its own forward, and the call that found it takes the eager result. With
  ``RESSERVE_NORM_LAUNCH=extension`` (opt-in, not yet measured) the same steps launch from the
  project's CUDA extension (kernels/rms_norm.cu) instead of Triton's Python launcher, which cost
  the host ≈ 65 µs a launch in the scores' profile on an H100 (`_from_extension`).
- ``all`` (`_FusedNorm`, ``RESSERVE_FUSED_NORM=1``): the forward reads each row once and writes
  the output and the row's 1/rms; the backward reads the row, the output's gradient and the weight
  once and writes the input's gradient. Their sums run in another order, so a few values differ in
  the last bit, and through the rest of the model that moves the scores: on an H100 by up to 9e-4
  relative, beyond the 2e-4 of the default kernels.
- ``backward`` (`_NormBackward`, ``RESSERVE_FUSED_NORM=backward``): the module's own forward and
  the fused backward kernel, which recomputes 1/rms from x (two runs on one H100: the forward +
  backward 0.44–0.49 s against 0.53–0.62 s eager, but the scores moved by 2.4–2.7e-4).
- None (``RESSERVE_FUSED_NORM=0``): the modules' own forward and autograd.

Weights are frozen while scoring, so no weight gradient is formed. Two forms, as transformers
writes them: Llama's ``w · narrow(x · r)`` (Llama, Qwen, Mistral and most families) and Gemma's
``narrow(x · r · (1 + w))``, with r = rsqrt(mean(x²) + ε), both in FP32 (the narrowing to bf16 is
done on the bits, so the interpreter that the CPU tests run rounds as the GPU does), for bf16 and
fp16 inputs. Which form, if any, a norm class computes is not taken on trust: on its first call
in a `fused_norms` block the module's own forward and its autograd backward run too, and the
class is swapped only if one form gives its output and the input's gradient bit for bit
(``exact``) or within two units in the last place everywhere and bit for bit on at least 99% of
the elements (``all``, ``backward``); anything else, or a call with more arguments, a weight that
wants a gradient or a dtype mix the forms do not cover, takes the module's own forward.

On CUDA with Triton (`available`); ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (how
the tests check them without a GPU); ``RESSERVE_BACKEND=reference`` forces the eager path.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch
from torch import nn

from resserve_export.algorithms import kernel
from resserve_export.core.compiling import identical, kernel_available, launch_device, triton_kernel

# How the kernels round their FP32 results to the input's dtype (a constexpr of both kernels).
# FP32 models keep their own norms: there an ulp of difference in a row's 1/rms moves the last
# bit of the whole row, and those models are not what the GPU scores are slow on.
_KIND = {torch.bfloat16: 1, torch.float16: 2}
_FORMS = ("llama", "gemma")
# What a form must reach on a class's first call to be used for it (module docstring).
_MAX_ULPS = 2
_MIN_IDENTICAL = 0.99


@triton_kernel
def _kernels(triton, tl):
    # Rounding an FP32 value to nearest-even at the input's precision, kept in FP32 (then exact
    # to store): written out in each kernel (a helper @jit function defined here would not be
    # found by the interpreter). bf16 on the bits, so that the interpreter rounds as the GPU.
    @triton.jit
    def fwd(x_ptr, w_ptr, y_ptr, r_ptr, N, ld_x, ld_y, eps, inv_n, GEMMA: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        x = tl.load(x_ptr + row * ld_x + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
        h = x * r
        if not GEMMA:  # Llama: h narrowed first, then the weight's product
            if KIND == 1:
                u = h.to(tl.uint32, bitcast=True)
                h = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            elif KIND == 2:
                h = h.to(tl.float16).to(tl.float32)
            y = w * h
        else:
            y = h * (1.0 + w)
        if KIND == 1:
            u = y.to(tl.uint32, bitcast=True)
            y = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(y_ptr + row * ld_y + cols, y.to(y_ptr.dtype.element_ty), mask=inside)
        tl.store(r_ptr + row, r)

    @triton.jit
    def bwd(x_ptr, w_ptr, r_ptr, dy_ptr, dx_ptr, N, ld_x, ld_dy, ld_dx, eps, inv_n,
            GEMMA: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr, RECOMPUTE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        x = tl.load(x_ptr + row * ld_x + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * ld_dy + cols, mask=inside, other=0.0).to(tl.float32)
        if RECOMPUTE:  # the forward was the module's own: the row's 1/rms from x, as `fwd` has it
            r = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
        else:
            r = tl.load(r_ptr + row)
        # The eager chain's backward, step by step: the weight's product (rounded to the input's
        # dtype in Llama's form), then h = x·r, r = rsqrt(u) (−½·g·r³), u = mean(x²) (g / N) and
        # x² (g·2x), the two paths into x added, narrowed once.
        if GEMMA:
            gh = dy * (1.0 + w)
        else:
            gh = dy * w
            if KIND == 1:
                u = gh.to(tl.uint32, bitcast=True)
                gh = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            elif KIND == 2:
                gh = gh.to(tl.float16).to(tl.float32)
        gu = (-0.5 * tl.sum(gh * x, axis=0)) * (r * r * r)
        dx = gh * r + (gu / N) * (2.0 * x)
        if KIND == 1:
            u = dx.to(tl.uint32, bitcast=True)
            dx = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(dx_ptr + row * ld_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)

    return fwd, bwd


@triton_kernel
def _exact_kernels(triton, tl):
    # The `exact` mode's kernels: only the elementwise steps of the eager chain, each rounded where
    # the eager op rounds (no FMA: launched with enable_fp_fusion=False). The two row reductions
    # (the forward's mean of x², the backward's row sum of the product into 1/rms) stay PyTorch's
    # own ops on a tensor of the layout autograd gives them, so they sum in PyTorch's order.
    @triton.jit
    def square(x_ptr, p_ptr, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(p_ptr + row * N + cols, x * x, mask=inside)

    @triton.jit
    def output(x_ptr, w_ptr, r_ptr, y_ptr, N, GEMMA: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        h = x * tl.load(r_ptr + row)
        if not GEMMA:  # Llama: w · narrow(h), the product in FP32 and narrowed
            if KIND == 1:
                u = h.to(tl.uint32, bitcast=True)
                h = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            else:
                h = h.to(tl.float16).to(tl.float32)
        y = w * h  # Gemma: w holds 1 + w in FP32
        if KIND == 1:
            u = y.to(tl.uint32, bitcast=True)
            y = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def backward(dy_ptr, w_ptr, x_ptr, r_ptr, gp_ptr, out_ptr, N, d1, d2, s0, s1, s2, o0, o1, o2,
                 GEMMA: tl.constexpr, KIND: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
        # Row `row` of x (contiguous) is row (i0, i1, i2) of dy and out, at their strides.
        row = tl.program_id(0).to(tl.int64)
        i2 = row % d2
        i1 = (row // d2) % d1
        i0 = row // (d1 * d2)
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + i0 * s0 + i1 * s1 + i2 * s2 + cols, mask=inside, other=0.0).to(tl.float32)
        gh = dy * w  # the output product's gradient: narrowed in Llama's form (a product of two narrow values)
        if not GEMMA:
            if KIND == 1:
                u = gh.to(tl.uint32, bitcast=True)
                gh = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            else:
                gh = gh.to(tl.float16).to(tl.float32)
        if GRAD:  # x's gradient: gh·r (the product x·r) plus (g/N)·(2x) (x²), narrowed once
            dx = gh * tl.load(r_ptr + row) + tl.load(gp_ptr + row) * (2.0 * x)
            if KIND == 1:
                u = dx.to(tl.uint32, bitcast=True)
                dx = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            tl.store(out_ptr + i0 * o0 + i1 * o1 + i2 * o2 + cols, dx.to(out_ptr.dtype.element_ty), mask=inside)
        else:  # the product whose row sum is 1/rms's gradient
            tl.store(out_ptr + i0 * o0 + i1 * o1 + i2 * o2 + cols, gh * x, mask=inside)

    return square, output, backward


def mode() -> str | None:
    """How the grad scores run their RMSNorms where the kernels run: ``exact`` (the default: the
    eager chain's bits through `_ExactNorm`), ``all`` (both fused kernels, ``RESSERVE_FUSED_NORM=1``),
    ``backward`` (the module's own forward, the fused backward kernel: ``=backward``) or None
    (their own forward and autograd: ``=0``)."""
    flag = os.environ.get("RESSERVE_FUSED_NORM", "")
    return {"": "exact", "exact": "exact", "1": "all", "backward": "backward"}.get(flag)


def available(device: torch.device) -> bool:
    """Whether the kernels run for tensors on `device`: CUDA with Triton (CPU tensors under
    ``TRITON_INTERPRET=1``), unless ``RESSERVE_BACKEND=reference``."""
    return kernel_available(device, _kernels, interpret=True)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


class _FusedNorm(torch.autograd.Function):
    """RMSNorm of x ``[..., N]`` with weight w ``[N]`` (no gradient) in `form`; x's dtype out."""

    @staticmethod
    def forward(ctx, x, w, eps: float, gemma: bool):
        fwd, _ = _kernels()
        N = x.shape[-1]
        x2 = _rows(x, N)
        rows = x2.shape[0]
        y = torch.empty((rows, N), dtype=x.dtype, device=x.device)
        r = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = _next_power_of_2(N)
        if rows:
            with launch_device(x2):
                fwd[(rows,)](x2, w, y, r, N, x2.stride(0), y.stride(0), eps, _inv(N), GEMMA=gemma, KIND=_KIND[x.dtype], BLOCK=block, num_warps=_warps(block), enable_fp_fusion=False)
        ctx.save_for_backward(x2, w, r)
        ctx.gemma, ctx.shape, ctx.eps = gemma, x.shape, eps
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, r = ctx.saved_tensors
        return _backward(x2, w, r, dy, ctx.eps, ctx.gemma).view(ctx.shape), None, None, None


class _NormBackward(torch.autograd.Function):
    """The module's own forward (its output bits), the fused kernel's backward: 1/rms is
    recomputed there from x, so only x (already alive as the norm's input) is kept, not the
    eager chain's FP32 copies."""

    @staticmethod
    def forward(ctx, x, w, eps: float, gemma: bool, own):
        y = own(x)
        ctx.save_for_backward(x, w)
        ctx.gemma, ctx.eps = gemma, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return _backward(x, w, None, dy, ctx.eps, ctx.gemma), None, None, None, None


class _ExactNorm(torch.autograd.Function):
    """RMSNorm of a contiguous x with the eager chain's bits, forward and backward: the
    elementwise steps in `_exact_kernels`, the two row reductions through PyTorch's own ops (module
    docstring). Keeps x and each row's 1/rms for the backward (not the eager chain's FP32 copies).
    `check`: called on the backward's arguments and result (None where the kernels raised), to
    compare them with autograd's (`_Checks.backward`); it may return the gradient to use instead."""

    @staticmethod
    def forward(ctx, x, w, eps: float, gemma: bool, check):
        N = x.shape[-1]
        rows = x.numel() // N if N else 0
        p = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        wk = (1.0 + w.float()) if gemma else w  # Gemma's factor, as the module forms it
        square, output, _ = _exact_steps(x, gemma)
        with launch_device(x):
            if rows:
                square(p)
            r = torch.rsqrt(p.mean(-1, keepdim=True) + eps)
            del p
            y = torch.empty_like(x, memory_format=torch.contiguous_format)
            if rows:
                output(wk, r, y)
        ctx.save_for_backward(x, wk, r)
        ctx.gemma, ctx.check = gemma, check
        return y

    @staticmethod
    def backward(ctx, dy):
        x, wk, r = ctx.saved_tensors
        try:
            dx = _exact_backward(x, wk, r, dy, ctx.gemma)
        except Exception:  # noqa: BLE001 - a kernel that cannot run here: the eager gradient (below)
            if ctx.check is None:
                raise
            dx = None
        if ctx.check is not None:
            dx = ctx.check(x, dy, dx)
        return dx, None, None, None, None


def _lead(t: torch.Tensor) -> tuple | None:
    """(d1, d2, s0, s1, s2): `t`'s leading dims (at most 3, padded in front) as the row index
    (i0, i1, i2) of `_exact_kernels.backward` and their strides, for a last dim of unit stride;
    else None."""
    if t.dim() < 1 or t.dim() > 4 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return None
    sizes = [1] * (4 - t.dim()) + list(t.shape[:-1])
    strides = [0] * (4 - t.dim()) + list(t.stride()[:-1])
    return sizes[1], sizes[2], strides[0], strides[1], strides[2]


def _exact_backward(x: torch.Tensor, wk: torch.Tensor, r: torch.Tensor, dy: torch.Tensor, gemma: bool) -> torch.Tensor:
    """x's gradient with the eager chain's bits. The product whose row sum is 1/rms's gradient is
    written in dy's layout, as autograd's product of the two would be, and summed by PyTorch; the
    per-row steps that follow are PyTorch's own ops on ``[..., 1]`` tensors."""
    N = x.shape[-1]
    rows = x.numel() // N if N else 0
    din = _lead(dy)
    if din is None:
        dy = dy.contiguous()
        din = _lead(dy)
    # dy's strides where dy is dense, else contiguous: a last dim of unit stride either way.
    t = torch.empty_like(dy, dtype=torch.float32)
    _, _, step = _exact_steps(x, gemma)
    with launch_device(x):
        if rows:
            step(dy, din, wk, r, r, t, False)
        s = t.sum(-1, keepdim=True)
        del t
        # rsqrt's backward (−½·g·r³), then the mean's (g / N), as autograd's formulas write them.
        gp = (((-0.5 * s) * r.pow(3)) / N).reshape(-1).contiguous()
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        if rows:
            step(dy, din, wk, r, gp, dx, True)
    return dx


def _exact_steps(x: torch.Tensor, gemma: bool) -> tuple:
    """`_ExactNorm`'s three elementwise steps on x (contiguous ``[..., N]``), each a callable that
    launches it over x's rows through the launcher `_from_extension` picks: ``square(p)`` (p = x²),
    ``output(wk, r, y)`` and ``backward(dy, din, wk, r, gp, out, grad)`` (din: dy's `_lead`)."""
    N = x.shape[-1]
    if _from_extension(x):
        return (
            lambda p: kernel.norm_square(x, p),
            lambda wk, r, y: kernel.norm_output(x, wk, r, y, gemma),
            lambda dy, din, wk, r, gp, out, grad: kernel.norm_backward(dy, wk, x, r, gp, out, gemma, grad, (*din, *_lead(out)[2:])),
        )
    square, output, backward = _exact_kernels()
    rows, block, kind = x.numel() // N if N else 0, _next_power_of_2(N), _KIND[x.dtype]
    fixed = {"GEMMA": gemma, "KIND": kind, "BLOCK": block, "num_warps": _warps(block), "enable_fp_fusion": False}
    return (
        lambda p: square[(rows,)](x, p, N, BLOCK=block, num_warps=_warps(block)),
        lambda wk, r, y: output[(rows,)](x, wk, r, y, N, **fixed),
        lambda dy, din, wk, r, gp, out, grad: backward[(rows,)](dy, wk, x, r, gp, out, N, *din, *_lead(out)[2:], GRAD=grad, **fixed),
    )


def _from_extension(x: torch.Tensor) -> bool:
    """Whether `_ExactNorm` launches its steps through the project's CUDA extension
    (kernels/rms_norm.cu, ``RESSERVE_NORM_LAUNCH=extension``) instead of its Triton kernels: the same
    steps and roundings, a C++ launch's host cost instead of Triton's launcher (≈ 65 µs a launch,
    four a norm and pass, in the scores' host profile on an H100: bench/results/plan.md). Opt-in
    until measured on a GPU; each class is still checked against its own forward and autograd."""
    return x.is_cuda and os.environ.get("RESSERVE_NORM_LAUNCH", "") == "extension" and kernel.KERNEL_AVAILABLE


def _backward(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None, dy: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """The input's gradient ``[rows, N]`` (x's dtype) through the backward kernel; r None: the
    kernel recomputes each row's 1/rms from x."""
    _, bwd = _kernels()
    N = x.shape[-1]
    x2, dy2 = _rows(x, N), _rows(dy, N)
    rows = x2.shape[0]
    dx = torch.empty((rows, N), dtype=x2.dtype, device=x2.device)
    block = _next_power_of_2(N)
    if rows:
        with launch_device(x2):
            bwd[(rows,)](
                x2, w, x2 if r is None else r, dy2, dx, N, x2.stride(0), dy2.stride(0), dx.stride(0), eps, _inv(N),
                GEMMA=gemma, KIND=_KIND[x2.dtype], BLOCK=block, RECOMPUTE=r is None, num_warps=_warps(block), enable_fp_fusion=False,
            )
    return dx.view(x.shape)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` as ``[rows, n]`` with unit column stride (a view where it already has one)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@functools.lru_cache(maxsize=None)
def _inv(n: int) -> float:
    """The mean's factor 1/n as an FP32 number (what the forward kernel and the recomputation use)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / n)


def _next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> torch.Tensor:
    """RMSNorm of x in `form` (``llama`` or ``gemma``) through the kernels; `available` must hold."""
    if form not in _FORMS:
        raise ValueError(f"unknown RMSNorm form {form!r}, available: {list(_FORMS)}")
    if not _covered(x, weight, form):
        raise ValueError(f"the fused RMSNorm covers bf16/fp16 inputs of width {weight.shape[0]} (with a weight of the same dtype in the llama form); got {x.dtype} of width {x.shape[-1]} and a {weight.dtype} weight")
    return _fused(x, weight, eps, form)


def _fused(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> torch.Tensor:
    """`fused_rms_norm` for a caller that has checked `_covered` itself (`fused_norms`, per call)."""
    return _FusedNorm.apply(x, weight.detach(), float(eps), form == "gemma")


def _apply(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str, own, how: str, check=None) -> torch.Tensor:
    """The norm of x in `form` as `how` (`mode`) has it; `own`: the module's own forward; `check`:
    `_ExactNorm`'s (``exact`` only)."""
    if how == "all":
        return _fused(x, weight, eps, form)
    if how == "exact":
        return _ExactNorm.apply(x, weight.detach(), float(eps), form == "gemma", check)
    return _NormBackward.apply(x, weight.detach(), float(eps), form == "gemma", own)


def _form_of(weight: torch.Tensor, eps: float, x: torch.Tensor, own, how: str) -> str | None:
    """The form whose kernels stand for the module's own forward and its autograd backward on x
    (for the output and for the input's gradient under a fixed random output gradient: `identical`
    in the ``exact`` mode, else `agrees`), or None."""
    xd = x.detach()
    same = identical if how == "exact" else agrees
    g = torch.Generator(device=xd.device).manual_seed(0)
    with torch.enable_grad():
        xw = xd.clone().requires_grad_(True)
        want = own(xw)
        dy = torch.randn(want.shape, generator=g, device=xd.device, dtype=torch.float32).to(want.dtype)
        (gx_want,) = torch.autograd.grad(want, xw, dy)
        for form in _FORMS:
            if not _covered(xd, weight, form) or (how == "exact" and not _exact_input(xd)):
                continue
            xf = xd.clone().requires_grad_(True)
            try:
                got = _apply(xf, weight, eps, form, own, how)
                (gx,) = torch.autograd.grad(got, xf, dy)
            except Exception:  # noqa: BLE001 - kernels that cannot run here: the module's own forward
                if how != "exact":
                    raise
                return None
            if same(got.detach(), want.detach()) and same(gx, gx_want):
                return form
    return None


def _exact_input(x: torch.Tensor) -> bool:
    """Whether `_ExactNorm` takes x: contiguous, at most 4 dims, not empty."""
    return x.is_contiguous() and 1 <= x.dim() <= 4 and x.numel() > 0


class _Checks:
    """The ``exact`` mode's checks beyond a class's first call, each made once: the output for
    every new (width, dtype), and x's gradient for every new layout of the output's gradient (the
    backward's row sum runs on a tensor of that layout), each against the module's own forward and
    autograd, bit for bit. A mismatch, or a kernel that raises, sends the class back to its own
    forward from then on, and the call that found it takes the eager result."""

    def __init__(self, forms: dict):
        self.forms, self.seen = forms, set()

    def output(self, cls, x, y, own) -> torch.Tensor | None:
        key = (cls, "out", x.shape[-1], x.dtype)
        if key in self.seen:
            return y
        with torch.no_grad():
            want = own(x.detach())
        if not identical(y.detach(), want):
            self.forms[cls] = None
            return None
        self.seen.add(key)
        return y

    def backward(self, cls, own):
        def check(x, dy, dx):
            key = (cls, "grad", x.shape[-1], x.dtype, dy.dim(), tuple(sorted(range(dy.dim()), key=lambda d: -dy.stride(d))), dy.is_contiguous())
            if dx is not None and key in self.seen:
                return dx
            with torch.enable_grad():
                xw = x.detach().requires_grad_(True)
                (want,) = torch.autograd.grad(own(xw), xw, dy)
            if dx is None or not identical(dx, want):
                self.forms[cls] = None
                return want
            self.seen.add(key)
            return dx

        return check


def _eps_of(mod: nn.Module) -> float | None:
    """The ε of a module that looks like an RMSNorm (class name, one 1-D weight), else None."""
    if not type(mod).__name__.endswith("RMSNorm"):
        return None
    w = getattr(mod, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        return None
    for name in ("variance_epsilon", "eps"):
        eps = getattr(mod, name, None)
        if isinstance(eps, float):
            return eps
    return None


def _covered(x: torch.Tensor, w: torch.Tensor, form: str) -> bool:
    """Whether a form's kernels cover these dtypes: the eager Llama form's output takes the
    weight's dtype, so it must be x's; Gemma's is x's own."""
    return x.dtype in _KIND and x.shape[-1] == w.shape[0] and (form == "gemma" or w.dtype == x.dtype)


def agrees(y: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a fused kernel's `y` stands for the eager `want`: the same shape and dtype, within
    `_MAX_ULPS` units in the last place everywhere and bit for bit on `_MIN_IDENTICAL` of the
    elements (also `mlp`'s rule)."""
    if y.shape != want.shape or y.dtype != want.dtype:
        return False
    a, b = y.float(), want.float()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if not bool(same.all()):
        ulp = torch.finfo(y.dtype).eps * b.abs() + torch.finfo(y.dtype).tiny
        if not bool(((a - b).abs() <= _MAX_ULPS * ulp)[~same].all()):
            return False
    return float(same.float().mean()) >= _MIN_IDENTICAL


@contextmanager
def fused_norms(model: nn.Module):
    """Every RMSNorm of `model` through the kernels inside the block, as `mode` says and where
    `available` (else nothing changes); each class's form is checked on its first call (module
    docstring). Restored on exit. Yields ``{norm class: form or None}`` as the calls decide them
    (None: the class keeps its own forward), or None where nothing is swapped."""
    norms = [(m, eps) for m in model.modules() if (eps := _eps_of(m)) is not None]
    how = mode()
    if not norms or how is None or not available(norms[0][0].weight.device):
        yield None
        return
    forms: dict[type, str | None] = {}
    checks = _Checks(forms)

    def patched(mod: nn.Module, eps: float):
        own = mod.forward

        def forward(*args, **kwargs):
            if kwargs or len(args) != 1 or mod.weight.requires_grad or not isinstance(args[0], torch.Tensor):
                return own(*args, **kwargs)
            x = args[0]
            cls = type(mod)
            if cls not in forms:
                forms[cls] = _form_of(mod.weight, eps, x, own, how)
            form = forms[cls]
            if form is None or not _covered(x, mod.weight, form):
                return own(x)
            if how != "exact":
                return _apply(x, mod.weight, eps, form, own, how)
            if not _exact_input(x):
                return own(x)
            try:
                y = _apply(x, mod.weight, eps, form, own, how, checks.backward(cls, own))
            except Exception:  # noqa: BLE001 - a kernel that cannot run here: the class keeps its own
                forms[cls] = None
                return own(x)
            y = checks.output(cls, x, y, own)
            return own(x) if y is None else y

        return forward

    before = [(mod, mod.__dict__.get("forward")) for mod, _ in norms]
    try:
        for mod, eps in norms:
            mod.forward = patched(mod, eps)
        yield forms
    finally:
        for mod, prior in before:
            if prior is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = prior
