"""Column sums of |x| that do not depend on the order of addition: exact per exponent band.

``--moe-calib all`` runs every expert on every token, and its statistics are Σ|act(gate)·up| per
expert and column over a batch's rows. Summed in float64 in one pass, such a sum is exact, so
the same in any order, only while the column's largest term over its smallest nonzero one, times
the row count, fits float64's 53 bits. ``silu`` of a very negative gate is tiny (silu(-60) ≈
5e-25 beside values near 10), which breaks that: the float64 sum then depends on the order of
addition, and a fused kernel could not give the eager reduction's bits.

Here each term goes to a band by the exponent field of its float32 value (``biased exponent //
BAND``, `BANDS` bands). Inside a band a bf16 term's magnitude over the smallest unit of any term
of the band is below 2^(BAND + 7) (2^(BAND + 10) for fp16), so with `MAX_ROWS` rows (2^22) or
fewer every partial sum of a band is an integer multiple of that unit below 2^53: exact in
float64, whatever the order (a tree, atomics, several programs). The bands are then added from
the lowest to the highest, one float64 addition each.

The result is the same on every device, for every grouping of rows, and equals the plain float64
sum whenever that one is exact (then every partial sum of the bands is a partial sum of the exact
terms, so no addition rounds): statistics taken before this module are unchanged on all inputs
where the float64 sum was exact. A batch of more than `MAX_ROWS` rows is taken `MAX_ROWS` rows at
a time, each part added to the accumulator in order.

The Triton kernel (`available`) computes the bands in one pass over the rows, from ``|x|`` or,
fused, from a gate/up product as ``silu(gate) · up`` rounded as PyTorch rounds it (checked
against ``F.silu`` on every value of the dtype once per process before it is used); `band_sums`
is the eager reference, the same bands by ``scatter_add``.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

from resserve_export.core.compiling import kernel_available, triton_kernel

BAND = 21  # float32 exponent values per band
BANDS = 256 // BAND + 1  # 13: biased exponents 0..255
MAX_ROWS = 1 << 22  # rows summed in one banded pass (fp16: 2^22 · 2^31 ≤ 2^53)
EXACT_DTYPES = (torch.bfloat16, torch.float16)

_ROWS = 64  # rows per tile
_COLS = 32  # columns per program
_SPLITS = 16  # programs per (expert, column block), each over its share of the rows
_WARPS = 4


def bands_of(a: torch.Tensor) -> torch.Tensor:
    """The band (int64) of each |value| in `a` (bf16 / fp16 / float32): its float32 biased
    exponent // `BAND`."""
    bits = a.float().view(torch.int32)
    return ((bits >> 23) & 0xFF).to(torch.int64) // BAND


def collapse(bands: torch.Tensor) -> torch.Tensor:
    """``[..., BANDS, K]`` band sums to ``[..., K]``: the bands added from the lowest up."""
    out = bands[..., 0, :].clone()
    for k in range(1, bands.shape[-2]):
        out += bands[..., k, :]
    return out


def band_sums(h: torch.Tensor) -> torch.Tensor:
    """Σ|h| over the rows of each ``h[c]`` (``[experts, rows, K]``) per band: ``[experts, BANDS, K]``
    float64, eagerly (one expert and `MAX_ROWS`-bounded row block at a time, so the temporaries stay
    a few times one expert's rows)."""
    c, n, k = h.shape
    out = torch.zeros(c, BANDS, k, dtype=torch.float64, device=h.device)
    step = max(1, min(n, (1 << 24) // max(1, k)))
    for e in range(c):
        for r0 in range(0, n, step):
            a = h[e, r0 : r0 + step].abs()
            out[e].scatter_add_(0, bands_of(a), a.to(torch.float64))
    return out


def exact_abs_sums(h: torch.Tensor) -> torch.Tensor:
    """Σ|h| over rows, per expert and column (``[experts, rows, K]`` → ``[experts, K]`` float64),
    by exponent band (module docstring), eagerly."""
    n = h.shape[1]
    total = None
    for r0 in range(0, max(n, 1), MAX_ROWS):
        part = collapse(band_sums(h[:, r0 : r0 + MAX_ROWS]))
        total = part if total is None else total + part
    return total


@triton_kernel
def _kernel(triton, tl):
    @triton.jit
    def banded(src_ptr, out_ptr, amax_ptr, meta_ptr, K, stride_e, stride_r, up_off,
               FUSED: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
               ROWS: tl.constexpr, COLS: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, W: tl.constexpr):
        e = tl.program_id(0).to(tl.int64)
        cb = tl.program_id(1)
        split = tl.program_id(2)
        cols = cb * COLS + tl.arange(0, COLS)
        cm = cols < K
        ks = tl.arange(0, NBP)
        acc = tl.zeros([NBP, COLS], dtype=tl.float64)
        peak = tl.zeros([COLS], dtype=tl.float32)
        n = tl.load(meta_ptr)  # rows (a scalar loaded, not an argument: loop bounds in Triton's interpreter too)
        rows_per_split = tl.load(meta_ptr + 1)
        r_lo = split * rows_per_split
        for r0 in range(r_lo, r_lo + rows_per_split, ROWS):  # rows_per_split: a multiple of ROWS
            rows = r0 + tl.arange(0, ROWS)
            m = (rows < n)[:, None] & cm[None, :]
            ptr = src_ptr + e * stride_e + rows[:, None].to(tl.int64) * stride_r + cols[None, :]
            x = tl.load(ptr, mask=m, other=0.0)
            if FUSED:
                g = x.to(tl.float32)
                u = tl.load(ptr + up_off, mask=m, other=0.0).to(tl.float32)
                if LIBDEVICE_EXP:
                    ex = tl.extra.cuda.libdevice.exp(-g)
                else:
                    ex = tl.exp(-g)
                s = tl.math.div_rn(g, 1.0 + ex)
                s = s.to(x.dtype).to(tl.float32)
                h = tl.abs((s * u).to(x.dtype).to(tl.float32))
            else:
                h = tl.abs(x.to(tl.float32))
            h = tl.where(m, h, 0.0)
            band = ((h.to(tl.int32, bitcast=True) >> 23) & 0xFF) // W
            live = m & (h != 0.0)
            lo = tl.min(tl.where(live, band, NB), axis=None)
            hi = tl.max(tl.where(live, band, -1), axis=None)
            h64 = h.to(tl.float64)
            for k in range(lo, hi + 1):
                part = tl.sum(tl.where(band == k, h64, 0.0), axis=0)
                acc += tl.where(ks[:, None] == k, part[None, :], 0.0)
            peak = tl.maximum(peak, tl.max(tl.where(h != h, float("inf"), h), axis=0))  # tl.max drops NaN: +inf instead
        offs = ((split * tl.num_programs(0) + e) * NB + ks[:, None]) * K + cols[None, :]
        tl.store(out_ptr + offs, acc, mask=(ks[:, None] < NB) & cm[None, :])
        p = tl.max(peak, axis=0)
        tl.atomic_max(amax_ptr + e, tl.where(p != p, float("inf"), p))  # the float atomic drops NaN: +inf instead

    return banded


def available(device: torch.device) -> bool:
    """Whether the Triton kernel runs for tensors on `device` (CUDA with Triton, unless
    ``RESSERVE_BACKEND=reference``)."""
    return kernel_available(device, _kernel)


def _launch(src: torch.Tensor, K: int, up_off: int, fused: bool, libdevice_exp: bool, acc_sum: torch.Tensor, acc_amax: torch.Tensor) -> None:
    c, n = src.shape[0], src.shape[1]
    for r0 in range(0, n, MAX_ROWS):
        part_src = src[:, r0 : r0 + MAX_ROWS]
        rows = part_src.shape[1]
        splits = max(1, min(_SPLITS, -(-rows // _ROWS)))
        per = -(-rows // splits)
        per = -(-per // _ROWS) * _ROWS
        out = torch.empty(splits, c, BANDS, K, dtype=torch.float64, device=src.device)
        _kernel()[(c, -(-K // _COLS), splits)](
            part_src, out, acc_amax, torch.tensor([rows, per], dtype=torch.int64).to(src.device, non_blocking=True), K,
            part_src.stride(0), part_src.stride(1), up_off,
            FUSED=fused, LIBDEVICE_EXP=libdevice_exp,
            ROWS=_ROWS, COLS=_COLS, NB=BANDS, NBP=16, W=BAND, num_warps=_WARPS,
        )
        acc_sum += collapse(out.sum(0))  # the splits' band sums are exact: any order of adding them is


def abs_stats(h: torch.Tensor, acc_sum: torch.Tensor, acc_amax: torch.Tensor) -> None:
    """Add Σ|h[c]| over rows (exact per band) into ``acc_sum[c]`` and fold max|h[c]| into
    ``acc_amax[c]``, for ``h`` ``[experts, rows, K]`` bf16 / fp16 on a CUDA device with Triton."""
    if h.stride(-1) != 1:
        h = h.contiguous()
    if h.shape[1] == 0:
        return
    _launch(h, h.shape[2], 0, False, False, acc_sum, acc_amax)


def silu_stats(prod: torch.Tensor, acc_sum: torch.Tensor, acc_amax: torch.Tensor) -> bool:
    """`abs_stats` of ``silu(gate) · up`` for `prod` ``[experts, rows, 2I]`` (gate the first I
    columns, up the rest), without the product in memory. False (nothing done) where this
    device's kernel does not round ``silu`` as PyTorch does."""
    variant = _silu_variant(prod.device, prod.dtype)
    if variant is None:
        return False
    if prod.stride(-1) != 1:
        prod = prod.contiguous()
    if prod.shape[1] == 0:
        return True
    i = prod.shape[2] // 2
    _launch(prod, i, i, True, variant, acc_sum, acc_amax)
    return True


@functools.lru_cache(maxsize=None)
def _silu_variant(device: torch.device, dtype: torch.dtype) -> bool | None:
    """Which exponential (False: Triton's, True: libdevice's) makes the fused kernel's
    ``silu(g) · u`` equal PyTorch's ``F.silu(g) * u`` on every value of `dtype` as the gate (up = 1)
    and on a million random pairs; None if neither does."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device=device).to(torch.int16).view(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    pairs = torch.randn(2, 1 << 20, device=device, generator=g) * torch.tensor([[8.0], [4.0]], device=device)
    cases = [(every, torch.ones_like(every)), (pairs[0].to(dtype), pairs[1].to(dtype))]
    for libdevice in (False, True):
        ok = True
        for gate, up in cases:
            prod = torch.cat([gate, up]).view(1, 1, -1)
            want = (F.silu(gate) * up).abs().double()
            got = torch.zeros(1, gate.numel(), dtype=torch.float64, device=device)
            peak = torch.zeros(1, dtype=torch.float32, device=device)
            try:
                _launch(prod, gate.numel(), gate.numel(), True, libdevice, got, peak)
            except Exception:  # noqa: BLE001 (a variant this Triton cannot build: the next, else the eager path)
                ok = False
                break
            if not torch.equal(torch.nan_to_num(got[0], nan=-1.0), torch.nan_to_num(want, nan=-1.0)):
                ok = False
                break
        if ok:
            return libdevice
    return None


__all__ = ["BAND", "BANDS", "MAX_ROWS", "EXACT_DTYPES", "bands_of", "collapse", "band_sums", "exact_abs_sums", "available", "abs_stats", "silu_stats"]
