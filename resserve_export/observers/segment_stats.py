"""Per-expert statistics of rows sorted by expert, in one Triton pass on CUDA.

Calibration with ``--moe-calib routed`` needs, per expert, Σ|x| (float64), max |x| and the valid
row count over the rows routed to it: the gathered hidden rows (gate/up inputs) and
``act(gate) · up`` (down inputs), both already sorted by expert for the grouped GEMMs. In eager
PyTorch on a GPU that is a float64 one-hot product per chunk of rows plus scatter reductions:
~40 launches per layer and float64 copies of every row, which made the routed pass 1.97× the
bare forward on an H200 (bench/results/moe.md). Here one kernel per statistic reads each row
once:

- grid (expert, column block); each program walks its expert's segment of rows in order,
  adding ``|x|`` of the valid rows into a float64 tile ``[ROWS, COLS]``, reduces the tile's rows
  at the end (a fixed tree), and adds the result into the float64 accumulator: one program per
  accumulator element, no atomics, so the sums do not depend on scheduling. For bf16 / fp16 rows
  every product and partial sum is exact in float64 within the ranges activations take, as for
  the eager one-hot product;
- max |x| of the valid rows per expert by an atomic maximum (order-free); a NaN becomes +inf
  there (the float atomic would drop it), so a non-finite activation still fails calibration's
  finiteness check, and the sums keep the NaN;
- the valid-row count per expert (column block 0 adds it), which is the routed-token count.

Padding rows are skipped (``where``), not multiplied by zero, so a padded row's non-finite value
cannot reach a sum.

`available(device)`: Triton is importable and the device is CUDA, unless
``RESSERVE_BACKEND=reference``; the caller falls back to the eager reduction otherwise.
"""

from __future__ import annotations

import torch

from resserve_export.core.compiling import kernel_available, triton_kernel

_ROWS = 16
_COLS = 128


@triton_kernel
def _kernel(triton, tl):
    @triton.jit
    def _nanmax(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def seg_stats(x_ptr, keep_ptr, ends_ptr, sum_ptr, amax_ptr, count_ptr, K, stride_x,
                  COUNT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
        e = tl.program_id(0)
        kb = tl.program_id(1)
        end = tl.load(ends_ptr + e).to(tl.int64)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        cols = kb * COLS + tl.arange(0, COLS)
        cm = cols < K
        acc = tl.zeros([ROWS, COLS], dtype=tl.float64)
        peak = tl.zeros([ROWS, COLS], dtype=tl.float32)
        n = tl.zeros([ROWS], dtype=tl.int64)
        for r0 in range(start, end, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            rm = rows < end
            keep = tl.load(keep_ptr + rows, mask=rm, other=0) != 0
            m = keep[:, None] & cm[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
            a = tl.where(m, tl.abs(x.to(tl.float32)), 0.0)
            acc += a.to(tl.float64)
            peak = tl.maximum(peak, a, propagate_nan=tl.PropagateNan.ALL)
            n += keep.to(tl.int64)
        s = tl.sum(acc, axis=0)
        offs = e.to(tl.int64) * K + cols
        tl.store(sum_ptr + offs, tl.load(sum_ptr + offs, mask=cm, other=0.0) + s, mask=cm)
        p = tl.reduce(tl.reduce(peak, 1, _nanmax), 0, _nanmax)
        tl.atomic_max(amax_ptr + e, tl.where(p != p, float("inf"), p))  # the float atomic drops NaN: +inf instead
        if COUNT:
            if kb == 0:
                tl.store(count_ptr + e, tl.load(count_ptr + e) + tl.sum(n, axis=0))

    return seg_stats


def available(device: torch.device) -> bool:
    """Whether `segment_stats` runs for tensors on `device` (see the module docstring)."""
    return kernel_available(device, _kernel)


def segment_stats(rows: torch.Tensor, keep: torch.Tensor, ends: torch.Tensor, acc_sum: torch.Tensor, acc_amax: torch.Tensor,
                  acc_count: torch.Tensor | None = None) -> None:
    """For consecutive segments of `rows` [R, K] (segment e is rows ``ends[e-1]:ends[e]``, the
    cumulative per-expert row counts), over the rows whose `keep` [R] (bool) is set: add Σ|row|
    into float64 `acc_sum` [E, K], fold max|row| into float32 `acc_amax` [E], and add the kept-row
    count into int64 `acc_count` [E] when given. All on one CUDA device, accumulators contiguous."""
    E, K = acc_sum.shape
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] == 0 or E == 0:
        return
    assert acc_sum.dtype == torch.float64 and acc_amax.dtype == torch.float32 and acc_sum.is_contiguous() and acc_amax.is_contiguous()
    count = acc_count if acc_count is not None else acc_amax  # unused when COUNT is off
    _kernel()[(E, -(-K // _COLS))](
        rows, keep.view(torch.uint8), ends, acc_sum, acc_amax, count, K, rows.stride(0),
        COUNT=acc_count is not None, ROWS=_ROWS, COLS=_COLS, num_warps=4,
    )


__all__ = ["available", "segment_stats"]
