"""The grad scores' loss: the summed next-token cross-entropy over valid targets, and its gradient.

`next_token_loss` is L = Σ over targets t where positions t and t+1 are both valid tokens of
−log softmax(logits_t)[ids_{t+1}], with the log-softmax in FP32. Eagerly that is a chain of
full-vocabulary passes: the logits widened to FP32, the log-softmax written, and in the backward a
zero tensor for the gather, the log-softmax's gradient, its narrowing back to the logits' dtype
and the padding of the sliced-off last position, all ``[batch, seq, vocab]``. For a 151,936-token
vocabulary that is ≈ 30 GB of memory traffic per batch of 4 × 1024 tokens, and FP32 copies of
2.5 GB each alive at once.

By default on CUDA with Triton (`exact_wanted`) the loss is `_ExactLoss`: the forward as the eager
ops (the same loss bits and the same saved log-softmax), and the backward as one kernel that
writes the logits' gradient from the log-softmax with the eager chain's arithmetic and rounding,
checked bit for bit against the eager backward on the first call of each vocabulary and dtype
(a difference sends later calls to the eager loss). ``RESSERVE_FUSED_LOSS=0`` keeps the eager
loss.

On CUDA with Triton (`available`), and with ``RESSERVE_FUSED_LOSS=1`` (`wanted`: opt-in. On an
H100 the model's forward + backward fell from 0.54 to 0.48 s, the scores moved by up to 4e-4
relative, beyond the 2e-4 of the default kernels, and the scores from scratch were no faster;
bench/results/plan.md), the loss is one custom autograd function
(`_FusedLoss`) of two kernels: the forward reads each row of logits once (a running max and
sum of exponentials per lane, then the row's max M and log-sum log S), and the backward writes
the gradient ``exp((x − M) − log S) − onehot`` straight in the logits' dtype, zeros in the rows
that are no target, once per element (≈ 3.7 GB per batch above; nothing but M and log S, two FP32 numbers a
row, kept for the backward besides the logits the model already holds). The arithmetic is the
eager log-softmax's, ``(x − M) − log S`` in FP32 with the gradient rounded once to the logits'
dtype; the sums of exponentials run in another order, so gradients can differ from the eager ones
in the last bit of a few elements (GPU test: against the eager function, and the scores within
their stated tolerance). ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (how the tests
check their logic without a GPU); ``RESSERVE_BACKEND=reference`` forces the eager path.
"""

from __future__ import annotations

import os

import torch

from resserve_export.algorithms.scores.batches import valid_tokens
from resserve_export.core.compiling import identical, kernel_available, launch_device, triton_kernel

# Vocabulary columns per step of the forward's row loop, and per program of the backward.
_FWD_BLOCK = 2048
_BWD_BLOCK = 4096
# A finite stand-in for −∞ in the masked lanes (so that a lane that saw only padding adds
# exp(0)·exp(−huge − M) = 0 instead of a NaN from ∞ − ∞); far below any logit.
_LOW = -3.0e38


@triton_kernel
def _kernels(triton, tl):
    @triton.jit
    def fwd(x_ptr, tgt_ptr, ok_ptr, m_ptr, lg_ptr, nll_ptr, V, ld_x, LOW: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * ld_x
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], LOW, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for step in range(STEPS):  # STEPS = ⌈V / BLOCK⌉, fixed per vocabulary
            cols = step * BLOCK + lanes
            x = tl.load(base + cols, mask=cols < V, other=LOW).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        big = tl.max(m, axis=0)
        total = tl.sum(s * tl.exp(m - big), axis=0)
        lg = tl.log(total)
        tl.store(m_ptr + row, big)
        tl.store(lg_ptr + row, lg)
        ok = tl.load(ok_ptr + row) != 0
        t = tl.load(tgt_ptr + row)
        xt = tl.load(base + t).to(tl.float32)
        # −log softmax at the target, as the eager log-softmax forms it: (x − M) − log S.
        nll = -((xt - big) - lg)
        tl.store(nll_ptr + row, tl.where(ok, nll, 0.0))

    @triton.jit
    def bwd(x_ptr, g_ptr, tgt_ptr, ok_ptr, m_ptr, lg_ptr, gscale_ptr, V, ld_x, ld_g, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < V
        ok = tl.load(ok_ptr + row) != 0
        x = tl.load(x_ptr + row * ld_x + cols, mask=inside & ok, other=0.0).to(tl.float32)
        big = tl.load(m_ptr + row)
        lg = tl.load(lg_ptr + row)
        t = tl.load(tgt_ptr + row)
        gs = tl.load(gscale_ptr)
        # The eager backward: log-softmax's gO − exp(out)·ΣgO with gO = −g at the target.
        y = tl.exp((x - big) - lg) * gs - tl.where(cols == t, gs, 0.0)
        y = tl.where(ok, y, 0.0)
        tl.store(g_ptr + row * ld_g + cols, y.to(g_ptr.dtype.element_ty), mask=inside)

    return fwd, bwd


@triton_kernel
def _exact_kernel(triton, tl):
    @triton.jit
    def grad(lp_ptr, out_ptr, tgt_ptr, ok_ptr, g_ptr, S1, V, lp_b, lp_s, out_b, out_s, KIND: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):
        # Row (b, s) of the log-softmax (s < S - 1) and a block of its columns. The eager backward
        # of Σ −lp[target] over the valid rows: gO = −g at the target of a valid row (+0 elsewhere),
        # its row sum −g (+0 in a row that is not valid), then the log-softmax's gO − exp(lp)·sum,
        # narrowed to the logits' dtype.
        row = tl.program_id(0).to(tl.int64)
        b = row // S1
        s = row % S1
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < V
        ok = tl.load(ok_ptr + row) != 0
        t = tl.load(tgt_ptr + row)
        g = tl.load(g_ptr)
        lp = tl.load(lp_ptr + b * lp_b + s * lp_s + cols, mask=inside, other=0.0)
        go = tl.where(ok & (cols == t), -g, 0.0)
        total = tl.where(ok, -g, 0.0)
        if LIBDEVICE:  # CUDA's expf (what PyTorch's kernel calls), not Triton's exp2-based approximation
            e = tl.extra.cuda.libdevice.exp(lp)
        else:  # the interpreter (CPU tensors)
            e = tl.exp(lp)
        y = go - e * total
        if KIND == 1:  # to bf16, nearest-even, on the bits (the interpreter rounds as the GPU)
            u = y.to(tl.uint32, bitcast=True)
            y = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(out_ptr + b * out_b + s * out_s + cols, y.to(out_ptr.dtype.element_ty), mask=inside)

    return grad


# Whether `_ExactLoss`'s gradient was found equal to the eager one, per (vocabulary, dtype,
# device type): checked on the first call of each (`_ExactLoss.backward`).
_EXACT_CHECKED: dict[tuple, bool] = {}
_EXACT_BLOCK = 2048


class _ExactLoss(torch.autograd.Function):
    """`eager_loss` with its forward as PyTorch ops (the same loss bits) and its backward as one
    kernel (`_exact_kernel`) that writes the logits' gradient from the saved log-softmax: the
    eager chain's arithmetic and rounding, without its zero-filled FP32 tensors, scatter, copy and
    padding passes (≈ 4 GB of traffic per batch of 4 × 1024 tokens at a 151,936-token vocabulary,
    against ≈ 18). The first call for a vocabulary and dtype also runs the eager backward and
    compares the two bit for bit; a difference, or a kernel that cannot run, sends every later call
    to the eager loss, and that call takes the eager gradient."""

    @staticmethod
    def forward(ctx, logits, ids, target_ok):
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = torch.sum(nll[target_ok])
        key = _exact_key(logits)
        ctx.save_for_backward(lp, ids, target_ok.to(torch.int8))
        ctx.shape, ctx.dtype, ctx.key = logits.shape, logits.dtype, key
        ctx.logits = logits.detach() if key not in _EXACT_CHECKED else None
        return loss

    @staticmethod
    def backward(ctx, g):
        lp, ids, ok = ctx.saved_tensors
        B, S, V = ctx.shape
        out = torch.empty((B, S, V), dtype=ctx.dtype, device=lp.device)
        out[:, -1].zero_()
        tgt = ids[:, 1:].contiguous()
        gs = g.detach().to(device=lp.device, dtype=torch.float32).reshape(1)
        rows = B * (S - 1)
        try:
            if rows and V:
                with launch_device(lp):
                    _exact_kernel()[(rows, _cdiv(V, _EXACT_BLOCK))](
                        lp, out, tgt, ok.contiguous(), gs, S - 1, V, lp.stride(0), lp.stride(1), out.stride(0), out.stride(1),
                        KIND=1 if ctx.dtype == torch.bfloat16 else 0, LIBDEVICE=lp.is_cuda, BLOCK=_EXACT_BLOCK, num_warps=8, enable_fp_fusion=False,
                    )
        except Exception:  # noqa: BLE001 - a kernel that cannot run here: the eager chain, from now on
            _EXACT_CHECKED[ctx.key] = False
            return _eager_backward(lp, ids, ok.bool(), g, ctx.dtype), None, None
        if ctx.logits is not None:  # the first call of its kind: the eager backward too
            with torch.enable_grad():
                x = ctx.logits.requires_grad_(True)
                (want,) = torch.autograd.grad(eager_loss(x, ids, ok.bool()), x, g)
            same = identical(out, want)
            _EXACT_CHECKED[ctx.key] = same
            ctx.logits = None
            if not same:
                return want, None, None
        return out, None, None


def _eager_backward(lp: torch.Tensor, ids: torch.Tensor, target_ok: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logits' gradient of `eager_loss` from its saved log-softmax, by the ops autograd runs
    for it (the sum's and the selection's gradient, the gather's scatter into zeros, the
    log-softmax's backward, the narrowing and the padding of the last position)."""
    gn = torch.zeros(target_ok.shape, dtype=torch.float32, device=lp.device)
    gn[target_ok] = g.to(torch.float32)
    go = torch.zeros_like(lp).scatter_add_(-1, ids[:, 1:, None], -gn[..., None])
    gx = torch._log_softmax_backward_data(go, lp, -1, torch.float32).to(dtype)
    return torch.cat([gx, gx.new_zeros((gx.shape[0], 1, gx.shape[2]))], dim=1)


def _exact_key(logits: torch.Tensor) -> tuple:
    return (logits.shape[-1], logits.dtype, logits.device.type)


def exact_wanted(logits: torch.Tensor) -> bool:
    """Whether `next_token_loss` takes `_ExactLoss`: by default (``RESSERVE_FUSED_LOSS`` unset)
    where its kernel runs, for ``[batch, seq, vocab]`` bf16/fp16/FP32 logits with unit column
    stride, unless an earlier call found its gradient other than the eager one."""
    return (
        os.environ.get("RESSERVE_FUSED_LOSS", "") == ""
        and kernel_available(logits.device, _exact_kernel, interpret=True)
        and logits.dim() == 3
        and logits.shape[1] > 1
        and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and _EXACT_CHECKED.get(_exact_key(logits), True)
    )


def wanted() -> bool:
    """Whether `next_token_loss` takes the fused kernels where they run: ``RESSERVE_FUSED_LOSS=1``."""
    return os.environ.get("RESSERVE_FUSED_LOSS", "") == "1"


def available(device: torch.device) -> bool:
    """Whether the fused loss runs for logits on `device`: CUDA with Triton (CPU tensors under
    ``TRITON_INTERPRET=1``), unless ``RESSERVE_BACKEND=reference``."""
    return kernel_available(device, _kernels, interpret=True)


class _FusedLoss(torch.autograd.Function):
    """Σ of −log softmax(x_r)[t_r] over the rows r with ok_r (x: ``[rows, V]`` logits, any float
    dtype, unit column stride), FP32; the gradient in x's dtype (module docstring)."""

    @staticmethod
    def forward(ctx, x, tgt, ok):
        fwd, _ = _kernels()
        rows, V = x.shape
        m = torch.empty(rows, dtype=torch.float32, device=x.device)
        lg = torch.empty_like(m)
        nll = torch.empty_like(m)
        if rows:
            with launch_device(x):
                fwd[(rows,)](x, tgt, ok, m, lg, nll, V, x.stride(0), LOW=_LOW, BLOCK=_FWD_BLOCK, STEPS=_cdiv(V, _FWD_BLOCK), num_warps=8)
        ctx.save_for_backward(x, tgt, ok, m, lg)
        return nll.sum()

    @staticmethod
    def backward(ctx, g):
        _, bwd = _kernels()
        x, tgt, ok, m, lg = ctx.saved_tensors
        rows, V = x.shape
        out = torch.empty((rows, V), dtype=x.dtype, device=x.device)
        gs = g.detach().to(device=x.device, dtype=torch.float32).reshape(1)
        if rows:
            with launch_device(x):
                bwd[(rows, _cdiv(V, _BWD_BLOCK))](x, out, tgt, ok, m, lg, gs, V, x.stride(0), out.stride(0), BLOCK=_BWD_BLOCK, num_warps=8)
        return out, None, None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def eager_loss(logits: torch.Tensor, ids: torch.Tensor, target_ok: torch.Tensor) -> torch.Tensor:
    """The loss as PyTorch ops: FP32 log-softmax of every position but the last, the targets gathered."""
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.sum(nll[target_ok])


def fused_loss(logits: torch.Tensor, ids: torch.Tensor, target_ok: torch.Tensor) -> torch.Tensor:
    """`eager_loss` through the fused kernels (see the module docstring); `available` must hold."""
    B, S, V = logits.shape
    x = logits.reshape(B * S, V)
    if x.stride(-1) != 1:
        x = x.contiguous()
    # Row b·S + s predicts ids[b, s + 1]; the last position of every row predicts nothing.
    tgt = torch.zeros_like(ids)
    tgt[:, :-1] = ids[:, 1:]
    ok = torch.zeros((B, S), dtype=torch.int8, device=ids.device)
    ok[:, :-1] = target_ok
    return _FusedLoss.apply(x, tgt.reshape(-1).contiguous(), ok.reshape(-1))


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Σ of the next-token cross-entropy (FP32 log-softmax) over the targets where position t
    and t+1 are both valid tokens, and their count. Fused where `wanted` and `available`, else eager."""
    valid = valid_tokens(mask, ids)
    target_ok = valid[:, 1:] & valid[:, :-1]
    if wanted() and available(logits.device):
        loss = fused_loss(logits, ids, target_ok)
    elif exact_wanted(logits):
        loss = _ExactLoss.apply(logits, ids, target_ok)
    else:
        loss = eager_loss(logits, ids, target_ok)
    return loss, int(target_ok.sum())
