"""The grad scores' next-token loss: the eager formula, and the fused CUDA kernels against it."""

from __future__ import annotations

import math

import pytest
import torch

from resserve_export.algorithms.scores import loss as L
from tests.fixtures.kernels_triton import gpu_kernels, no_gpu, run_interpreted


def _case(dtype, B=3, S=9, V=5000, seed=0, device="cpu"):
    """Random logits with a wide spread, ids, and a mask with left and right padding."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, S, V, generator=g) * 6).to(dtype).to(device)
    ids = torch.randint(0, V, (B, S), generator=g).to(device)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, S - 3 :] = 0
    mask[2, :2] = 0
    return logits, ids, mask.to(device)


def _grads(fn, logits, ids, mask):
    x = logits.clone().requires_grad_(True)
    valid = mask.bool()
    ok = valid[:, 1:] & valid[:, :-1]
    value = fn(x, ids, ok)
    value.backward()
    return value.detach(), x.grad


@pytest.mark.parametrize("opt_in", ["0", "1"])
def test_cpu_loss_is_the_summed_fp32_log_softmax_over_valid_targets(opt_in, monkeypatch):
    """Without CUDA the loss is the eager formula, with or without ``RESSERVE_FUSED_LOSS=1``: −Σ
    log softmax over the targets whose position and predecessor are both valid, and their count."""
    monkeypatch.setenv("RESSERVE_FUSED_LOSS", opt_in)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits, ids, mask = _case(torch.bfloat16)
    value, n = L.next_token_loss(logits, ids, mask)
    lp = torch.log_softmax(logits.float(), dim=-1)
    want, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if mask[b, t] and mask[b, t + 1]:
                want -= float(lp[b, t, ids[b, t + 1]])
                count += 1
    assert n == count == 3 * 8 - 3 - 2
    assert math.isclose(float(value), want, rel_tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_backward_from_the_log_softmax_is_autograds(dtype):
    """`loss._eager_backward` (what `_ExactLoss` falls back to where its kernel cannot run): the
    logits' gradient of the eager loss from its saved log-softmax, bit for bit autograd's, for an
    incoming gradient of 1 and of another value."""
    logits, ids, mask = _case(dtype, V=700)
    valid = mask.bool()
    ok = valid[:, 1:] & valid[:, :-1]
    for g in (1.0, 0.37):
        x = logits.clone().requires_grad_(True)
        (L.eager_loss(x, ids, ok) * g).backward()
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        assert torch.equal(L._eager_backward(lp, ids, ok, torch.tensor(g), dtype), x.grad)


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |x| (2^-133 floor for zeros and subnormals)."""
    e = torch.floor(torch.log2(x.float().abs().clamp_min(2.0**-126)))
    return torch.exp2(e - 7)


def _check_fused(fused, eager, dtype, exact_fraction: float | None):
    (vf, gf), (ve, ge) = fused, eager
    assert math.isclose(float(vf), float(ve), rel_tol=1e-6), (float(vf), float(ve))
    assert gf.dtype == ge.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(gf, ge, rtol=1e-5, atol=1e-9)
    else:
        diff = (gf.float() - ge.float()).abs()
        assert bool((diff <= _ulp_bf16(torch.maximum(gf.float().abs(), ge.float().abs()))).all()), float(diff.max())
        if exact_fraction is not None:
            assert float((gf == ge).float().mean()) >= exact_fraction


def _zero_where_no_target(grad, mask):
    valid = mask.bool()
    target = torch.zeros_like(valid)
    target[:, :-1] = valid[:, 1:] & valid[:, :-1]
    assert bool((grad[~target] == 0).all())
    assert bool((grad[target] != 0).any(dim=-1).all())


def _exact_cases(device: str) -> None:
    """The default loss where its kernel runs (`loss._ExactLoss`): the eager loss and gradient bit
    for bit. The first call of each vocabulary and dtype also compares its kernel with the eager
    backward and keeps the kernel only if the two agree; on a GPU they must (its exponential is
    CUDA's expf, as PyTorch's), under the interpreter at least in bf16 (numpy's exp against
    PyTorch's vectorised one may differ in FP32's last bit, and then the eager gradient is taken)."""
    import os

    os.environ.pop("RESSERVE_FUSED_LOSS", None)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        logits, ids, mask = _case(dtype, V=3000, device=device)
        L._EXACT_CHECKED.clear()
        assert L.exact_wanted(logits)
        eager = _grads(L.eager_loss, logits, ids, mask)
        for _ in range(2):  # the first call checks, the second runs the kernel alone if kept
            got = _grads(lambda x, i, ok: L.next_token_loss(x, i, mask)[0], logits, ids, mask)
            assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1]), dtype
        kept = L._EXACT_CHECKED[L._exact_key(logits)]
        assert kept or (device == "cpu" and dtype != torch.bfloat16), (device, dtype)
    # A kernel that cannot run: the eager chain's gradient, and the eager loss from then on.
    real = L._exact_kernel

    class _Broken:
        def __getitem__(self, grid):
            def launch(*a, **k):
                raise RuntimeError("no kernel here")

            return launch

    L._exact_kernel = lambda: _Broken()
    try:
        logits, ids, mask = _case(torch.bfloat16, V=3000, device=device)
        L._EXACT_CHECKED.clear()
        got = _grads(lambda x, i, ok: L.next_token_loss(x, i, mask)[0], logits, ids, mask)
        assert torch.equal(got[1], _grads(L.eager_loss, logits, ids, mask)[1])
        assert L._EXACT_CHECKED[L._exact_key(logits)] is False and not L.exact_wanted(logits)
    finally:
        L._exact_kernel = real
        L._EXACT_CHECKED.clear()
    # Another gradient than 1 flows through the same arithmetic.
    logits, ids, mask = _case(torch.bfloat16, V=3000, device=device)
    x = logits.clone().requires_grad_(True)
    (L.next_token_loss(x, ids, mask)[0] * 0.5).backward()
    y = logits.clone().requires_grad_(True)
    valid = mask.bool()
    (L.eager_loss(y, ids, valid[:, 1:] & valid[:, :-1]) * 0.5).backward()
    assert torch.equal(x.grad, y.grad)


def _interpreted_check() -> None:
    """Run under ``TRITON_INTERPRET=1`` (set before Triton is first imported: its own helper
    functions are made interpretable at import)."""
    import os

    assert L.available(torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        logits, ids, mask = _case(dtype, V=3000)
        fused = _grads(L.fused_loss, logits, ids, mask)
        eager = _grads(L.eager_loss, logits, ids, mask)
        _check_fused(fused, eager, dtype, exact_fraction=None)
        _zero_where_no_target(fused[1], mask)
        # next_token_loss takes them when asked to (and only then).
        for flag, want in (("1", fused[0]), ("0", eager[0])):
            os.environ["RESSERVE_FUSED_LOSS"] = flag
            assert torch.equal(L.next_token_loss(logits, ids, mask)[0], want)
    _exact_cases("cpu")


@no_gpu
def test_fused_kernels_logic_under_the_triton_interpreter():
    """The kernels' logic on CPU tensors, in a fresh interpreter with ``TRITON_INTERPRET=1``: the
    loss and its gradient as the eager function gives them. The interpreter truncates FP32 to bf16
    where the GPU rounds to nearest, so bf16 gradients are checked to one bf16 step here; the GPU
    test is stricter. Skipped where Triton is not installed (CPU-only torch does not bring it)."""
    run_interpreted("tests.algorithms.test_loss", timeout=300)


triton_gpu = gpu_kernels(L.available)


@pytest.mark.gpu
@triton_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_loss_gives_the_eager_gradient(dtype):
    """On CUDA, at a real vocabulary size (Qwen3's 151,936): the loss within 1e-6 of the eager one;
    FP32 gradients within 1e-5; bf16 gradients within one bf16 step everywhere and the same bits
    in ≥ 99% of the elements (the exponentials' sums run in another order); zero where no target."""
    logits, ids, mask = _case(dtype, B=3, S=33, V=151936, device="cuda")
    assert L.next_token_loss(logits, ids, mask)[1] == 3 * 32 - 3 - 2
    fused = _grads(L.fused_loss, logits, ids, mask)
    _check_fused(fused, _grads(L.eager_loss, logits, ids, mask), dtype, exact_fraction=0.99)
    _zero_where_no_target(fused[1], mask)


@pytest.mark.gpu
@triton_gpu
def test_gpu_exact_loss_is_the_eager_loss_bit_for_bit():
    """On CUDA the default loss's kernel gives the eager gradient bit for bit in bf16, fp16 and
    FP32 (and is kept), and the loss is the eager one (`_exact_cases`); at Qwen3's vocabulary too."""
    _exact_cases("cuda")
    logits, ids, mask = _case(torch.bfloat16, B=3, S=33, V=151936, device="cuda")
    L._EXACT_CHECKED.clear()
    got = _grads(lambda x, i, ok: L.next_token_loss(x, i, mask)[0], logits, ids, mask)
    eager = _grads(L.eager_loss, logits, ids, mask)
    assert torch.equal(got[1], eager[1]) and L._EXACT_CHECKED[L._exact_key(logits)]
