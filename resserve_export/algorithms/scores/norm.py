"""The grad scores' RMSNorms: forward and backward in one Triton kernel each.

Transformers' RMSNorms compute in FP32 as a chain of eager ops (widen, square, mean, rsqrt,
scale, narrow, weight), and their backward replays that chain through autograd with FP32 copies
of the hidden states at every step. The grad scores run a forward and a backward of the whole
model per batch; by a count of bytes these norms (two per layer on the hidden states, and Qwen3's
per-head q/k norms) are the largest share of the model's own non-GEMM memory traffic there
(bench/results/plan.md). `fused_norms` swaps every RMSNorm of a model for `_FusedNorm` during
those passes: the forward reads each row once and writes the output and the row's 1/rms; the
backward reads the row, the output's gradient and the weight once and writes the input's
gradient. Weights are frozen while scoring, so no weight gradient is formed.

Two forms, as transformers writes them: Llama's ``w · narrow(x · r)`` (Llama, Qwen, Mistral and
most families) and Gemma's ``narrow(x · r · (1 + w))``, with r = rsqrt(mean(x²) + ε), both in
FP32 with the same roundings as the eager ops (the narrowing to bf16 is done on the bits, so the
interpreter that the CPU tests run rounds as the GPU does), for bf16 and fp16 inputs. Which form, if any, a norm class
computes is not taken on trust: on its first call in a `fused_norms` block the module's own
forward and its autograd backward run too, and the class is fused only if one form gives its
output and the input's gradient within two units in the last place everywhere and bit for bit
on at least 99% of the elements (the sum of squares runs in another order, so the last bit of a
few values may differ); anything else, or a call
with more arguments, a weight that wants a gradient or a dtype mix the forms do not cover, takes
the module's own forward.

The forward kernel's sum of squares runs in another order than PyTorch's mean, so a few outputs
differ in their last bit, and through the rest of the model that moves the scores: on an H100 by
up to 9e-4 relative, beyond the 2e-4 of the default kernels (bench/results/plan.md). Hence a
second mode, `_NormBackward`: the module's own forward (its output bits, so every activation the
candidates quantize is as without fusion) and the backward kernel, which recomputes 1/rms from x
and so keeps only x for the backward, not the eager chain's FP32 copies. The check on a class's
first call then compares the input's gradient (under a fixed random output gradient) by the same
rule.

On CUDA with Triton (`available`), as `mode` says: ``RESSERVE_FUSED_NORM=1`` both kernels (on an
H100 the model's forward + backward fell from 0.54 to 0.36 s, the scores moved as above, and the
scores from scratch were no faster: they are bound by their host launches),
``RESSERVE_FUSED_NORM=backward`` the backward kernel alone (two runs on one H100: the forward +
backward 0.44–0.49 s against 0.53–0.62 s eager, but the scores still moved by 2.4–2.7e-4, past
the 2e-4 tolerance: the gradients differ in the last bit where 1/rms and the row sum are
computed in another order); both opt-in. ``TRITON_INTERPRET=1``
runs the kernels on CPU tensors (how the tests check them without a GPU);
``RESSERVE_BACKEND=reference`` forces the eager path.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch
from torch import nn

from resserve_export.core.compiling import kernel_available, launch_device, triton_kernel

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


def mode() -> str | None:
    """How the grad scores fuse their RMSNorms where the kernels run: ``all`` (forward and
    backward, ``RESSERVE_FUSED_NORM=1``), ``backward`` (the module's own forward, the backward
    kernel: ``RESSERVE_FUSED_NORM=backward``) or None (their own forward and autograd)."""
    flag = os.environ.get("RESSERVE_FUSED_NORM", "")
    return "all" if flag == "1" else "backward" if flag == "backward" else None


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


def _apply(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str, own, how: str) -> torch.Tensor:
    """The norm of x in `form` as `how` (`mode`) has it; `own`: the module's own forward."""
    if how == "all":
        return _fused(x, weight, eps, form)
    return _NormBackward.apply(x, weight.detach(), float(eps), form == "gemma", own)


def _form_of(weight: torch.Tensor, eps: float, x: torch.Tensor, own, how: str) -> str | None:
    """The form whose kernels stand for the module's own forward and its autograd backward on x
    (`agrees`, for the output and for the input's gradient under a fixed random output gradient),
    or None."""
    xd = x.detach()
    g = torch.Generator(device=xd.device).manual_seed(0)
    with torch.enable_grad():
        xw = xd.clone().requires_grad_(True)
        want = own(xw)
        dy = torch.randn(want.shape, generator=g, device=xd.device, dtype=torch.float32).to(want.dtype)
        (gx_want,) = torch.autograd.grad(want, xw, dy)
        for form in _FORMS:
            if not _covered(xd, weight, form):
                continue
            xf = xd.clone().requires_grad_(True)
            got = _apply(xf, weight, eps, form, own, how)
            (gx,) = torch.autograd.grad(got, xf, dy)
            if agrees(got.detach(), want.detach()) and agrees(gx, gx_want):
                return form
    return None


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
            return _apply(x, mod.weight, eps, form, own, how)

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
