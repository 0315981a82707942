"""The grad scores' gated MLPs: SiLU(gate) · up and its backward in one Triton kernel each.

A gated MLP computes ``down(silu(gate(x)) · up(x))``. Eagerly the activation and the product are
two kernels forward and four backward over ``[tokens, intermediate]`` tensors, the largest
activations of the model (three times the hidden width in Qwen3), and by a count of bytes the
second-largest share of the non-GEMM memory traffic of the grad scores' forward + backward after
the RMSNorms (bench/results/plan.md). `fused_mlps` runs the activation and the product of every
such MLP as `_SiluMul` during those passes: the forward reads gate and up once and writes the
product; the backward reads gate, up and the product's gradient once and writes both gradients.
The three linears still run as modules, so the score hooks on them see the same inputs and
gradients.

The kernels round as the eager ops do (SiLU in FP32 narrowed to the input's dtype, then the
product narrowed; backward: the product's two gradients narrowed, then SiLU's), bf16 on the bits
so that the interpreter rounds as the GPU does; ``exp`` is Triton's, so the last bit of a few
elements may differ. Which MLP classes are fused is not taken on trust: on entering
`fused_mlps`, for one module of each class with ``gate_proj``, ``up_proj``, ``down_proj`` and
``act_fn``, the module's own forward on a random input must equal ``down(silu(gate(x)) · up(x))``
bit for bit, and the kernels' forward and backward must give the eager activation's within two
units in the last place everywhere and bit for bit on at least 99% of the elements; any other
class, bf16/fp16 only, keeps its own forward.

On CUDA with Triton (`available`), and with ``RESSERVE_FUSED_MLP=1`` (`wanted`: opt-in. On an
H100 it saved nothing measurable, 0.536 against 0.531 s for the model's forward + backward;
bench/results/plan.md). ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (how the tests check
them without a GPU); ``RESSERVE_BACKEND=reference`` forces the eager path.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from resserve_export.algorithms.scores.norm import agrees
from resserve_export.core.compiling import kernel_available, launch_device, triton_kernel

_KIND = {torch.bfloat16: 1, torch.float16: 2}
_BLOCK = 2048


@triton_kernel
def _kernels(triton, tl):
    # Rounding to the input's precision, kept in FP32 (then exact to store), written out in each
    # kernel as in `norm`: bf16 on the bits, fp16 through a cast.
    @triton.jit
    def fwd(g_ptr, u_ptr, y_ptr, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        g = tl.load(g_ptr + i, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + i, mask=inside, other=0.0).to(tl.float32)
        s = g / (1.0 + tl.exp(-g))
        if KIND == 1:
            b = s.to(tl.uint32, bitcast=True)
            s = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            s = s.to(tl.float16).to(tl.float32)
        y = s * u
        if KIND == 1:
            b = y.to(tl.uint32, bitcast=True)
            y = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(y_ptr + i, y.to(y_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def bwd(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        g = tl.load(g_ptr + i, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + i, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + i, mask=inside, other=0.0).to(tl.float32)
        e = 1.0 + tl.exp(-g)  # SiLU and σ share it: s = g / e, σ = 1 / e
        sig = 1.0 / e
        s = g / e
        if KIND == 1:
            b = s.to(tl.uint32, bitcast=True)
            s = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            s = s.to(tl.float16).to(tl.float32)
        # The product's gradients, each narrowed (the eager bf16 multiplications), then SiLU's:
        # dy_s · σ · (1 + g · (1 − σ)), narrowed.
        ds = dy * u
        du = dy * s
        if KIND == 1:
            b = ds.to(tl.uint32, bitcast=True)
            ds = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            b = du.to(tl.uint32, bitcast=True)
            du = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            ds = ds.to(tl.float16).to(tl.float32)
        dg = ds * sig * (1.0 + g * (1.0 - sig))
        if KIND == 1:
            b = dg.to(tl.uint32, bitcast=True)
            dg = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(dg_ptr + i, dg.to(dg_ptr.dtype.element_ty), mask=inside)
        tl.store(du_ptr + i, du.to(du_ptr.dtype.element_ty), mask=inside)

    return fwd, bwd


def wanted() -> bool:
    """Whether the grad scores fuse their gated MLPs' activation where the kernels run: ``RESSERVE_FUSED_MLP=1``."""
    return os.environ.get("RESSERVE_FUSED_MLP", "") == "1"


def available(device: torch.device) -> bool:
    """Whether the kernels run for tensors on `device`: CUDA with Triton (CPU tensors under
    ``TRITON_INTERPRET=1``), unless ``RESSERVE_BACKEND=reference``."""
    return kernel_available(device, _kernels, interpret=True)


class _SiluMul(torch.autograd.Function):
    """silu(g) · u for g, u of one shape and dtype (bf16 or fp16), in that dtype."""

    @staticmethod
    def forward(ctx, g, u):
        fwd, _ = _kernels()
        g, u = g.contiguous(), u.contiguous()
        y = torch.empty_like(g)
        n = g.numel()
        if n:
            with launch_device(g):
                fwd[(-(-n // _BLOCK),)](g, u, y, n, KIND=_KIND[g.dtype], BLOCK=_BLOCK, num_warps=8)
        ctx.save_for_backward(g, u)
        return y

    @staticmethod
    def backward(ctx, dy):
        _, bwd = _kernels()
        g, u = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        n = g.numel()
        if n:
            with launch_device(g):
                bwd[(-(-n // _BLOCK),)](g, u, dy, dg, du, n, KIND=_KIND[g.dtype], BLOCK=_BLOCK, num_warps=8)
        return dg, du


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) · u through the kernels (`available` must hold; g, u bf16 or fp16 of one shape)."""
    if g.shape != u.shape or g.dtype != u.dtype or g.dtype not in _KIND:
        raise ValueError(f"silu_mul takes two bf16/fp16 tensors of one shape, not {g.dtype}{tuple(g.shape)} and {u.dtype}{tuple(u.shape)}")
    return _SiluMul.apply(g, u)


def _gated(mod: nn.Module) -> bool:
    return (
        all(isinstance(getattr(mod, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj"))
        and isinstance(getattr(mod, "act_fn", None), nn.Module)
        and mod.gate_proj.weight.dtype in _KIND
    )


def _fits(mod: nn.Module) -> bool:
    """Whether `mod` computes ``down(silu(gate(x)) · up(x))`` and the kernels give its activation
    (module docstring): checked on a random input, forward and backward."""
    w = mod.gate_proj.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(16, mod.gate_proj.in_features, generator=gen).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        g, u = mod.gate_proj(x), mod.up_proj(x)
        if not torch.equal(mod(x), mod.down_proj(F.silu(g) * u)):
            return False
    g, u = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    want = F.silu(g) * u
    dy = torch.randn(want.shape, generator=gen).to(device=w.device, dtype=w.dtype)
    want_g, want_u = torch.autograd.grad(want, (g, u), dy)
    got = silu_mul(g, u)
    got_g, got_u = torch.autograd.grad(got, (g, u), dy)
    return agrees(got.detach(), want.detach()) and agrees(got_g, want_g) and agrees(got_u, want_u)


@contextmanager
def fused_mlps(model: nn.Module):
    """Every gated SiLU MLP of `model` with its activation through the kernels inside the block,
    where `wanted` and `available` (else nothing changes); each class is checked on entry
    (module docstring), so enter before hooks that must not see the check's calls. Restored on
    exit. Yields ``{MLP class: fused or not}``, or None where nothing is swapped."""
    mlps = [m for m in model.modules() if _gated(m)]
    if not mlps or not (wanted() and available(mlps[0].gate_proj.weight.device)):
        yield None
        return
    fused: dict[type, bool] = {}
    for m in mlps:
        if type(m) not in fused:
            fused[type(m)] = _fits(m)
    chosen = [m for m in mlps if fused[type(m)]]

    def patched(mod: nn.Module):
        def forward(x):
            return mod.down_proj(silu_mul(mod.gate_proj(x), mod.up_proj(x)))

        return forward

    before = [(m, m.__dict__.get("forward")) for m in chosen]
    try:
        for m in chosen:
            m.forward = patched(m)
        yield fused
    finally:
        for m, prior in before:
            if prior is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = prior
