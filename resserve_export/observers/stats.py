"""Per-linear activation statistics (the salience): sum |x| and token counts in float64, and amax,
over the valid (non-padding) tokens, taken by forward pre-hooks on one member of each fused group."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch

from resserve_export.core.errors import UserError
from resserve_export.modeling.forward import forward_kwargs, input_device
from resserve_export.modeling.groups import Group
from resserve_export.modeling.hooks import Observer
from resserve_export.observers.finite import finite_each

# CPU hook reduction chunk: 2**19 floats (2 MiB in float32) stay in a core's L2/L3.
CPU_CHUNK_ELEMENTS = 1 << 19
# Inputs below this many elements take the eager reduction: compiling the fused one costs a few
# seconds once per process, more than it saves on a small calibration (a tiny model, a test).
COMPILED_MIN_ELEMENTS = 1 << 16


def _abs_sum_max(x):
    a = x.float().abs()
    return a.sum(0), a.amax()


@functools.lru_cache(maxsize=1)
def _compiled_cpu_reduce():
    """Σ|x| (FP32, per column) and max|x| fused into one pass over the activation by inductor.

    About 3x cheaper than the chunked eager reduction on CPU; None (eager fallback) when
    compilation is unavailable or disabled with RESSERVE_BACKEND=reference.
    """

    if os.environ.get("RESSERVE_BACKEND", "") == "reference":
        return None
    try:
        from resserve_export.core.compiling import compile_or_eager

        fn = compile_or_eager(_abs_sum_max, dynamic=True)
        probe = torch.arange(64, dtype=torch.float32).reshape(8, 8).to(torch.bfloat16) - 30
        s, m = fn(probe)
        ref = probe.float().abs()
        if not (torch.equal(s, ref.sum(0)) and torch.equal(m, ref.amax())):
            return None
        return fn
    except Exception:
        return None


def _same_rows(shape: tuple, batch: tuple) -> bool:
    """Whether leading dims `shape` are the batch's [B, T] with extra size-1 dims (DeepSeek's MLA
    feeds kv_b_proj [B, 1, T, r]) or flattened (Qwen2-MoE's shared expert reads [B·T, H]): its
    rows are then the batch's tokens in order."""
    return tuple(d for d in shape if d != 1) == tuple(d for d in batch if d != 1) or tuple(shape) == (math.prod(batch),)


class StatsCollector(Observer):
    """Forward pre-hooks accumulating Σ|x| (float64), valid-token count and amax per decision group.

    Use :meth:`set_mask` with each batch's attention mask before the forward pass and
    :meth:`end_batch` after it. Padding tokens (mask 0) never enter the statistics.
    """

    # GPU token reduction: "norm" (fused |x| in the reduction kernels) or "abs" (|x| materialised).
    gpu_reduction = "norm"

    def __init__(self, model, groups: list[Group], keep_batches: bool = False):

        super().__init__()
        self._torch = torch
        self.groups = groups
        # Every batch's partial sums too (data-parallel ranks: see `distributed`).
        self.keep_batches = keep_batches
        self._batches: list[list] = [[] for _ in groups]
        modules = dict(model.named_modules())
        self._sum: list = [None] * len(groups)
        self._amax: list = [None] * len(groups)
        self._first_call: list[int | None] = [None] * len(groups)
        self._calls = 0
        self.num_tokens = 0
        self._mask = None
        self._rows: dict = {}
        self._cpu_buf: dict = {}
        self._cpu_ones: dict = {}
        self.paused = False  # hooks do nothing while set (the sequential pipeline's score batches)
        for gi, g in enumerate(groups):
            head = g.modules[0]
            if head not in modules:
                raise UserError(f"linear {head} is not in the model: the weights and the architecture do not match")
            self.pre_hook(modules[head], self._make_hook(gi))

    def set_mask(self, attention_mask) -> None:
        """The current batch's validity ``[B, T]`` (1 = real token, 0 = padding)."""
        torch = self._torch
        self._rows = {}
        m = attention_mask.detach().to("cpu").bool()
        self._mask = m
        self._shape = tuple(m.shape)
        self._all_valid = bool(m.all())
        self._batch_tokens = int(m.sum())
        self._valid_idx = None if self._all_valid else torch.nonzero(m.reshape(-1)).reshape(-1)

    def _rows_for(self, x):
        """(index of valid rows or None, accumulation dtype) for x's device and dtype."""
        key = (x.device, x.dtype)
        r = self._rows.get(key)
        if r is None:
            torch = self._torch
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32
            idx = None if self._all_valid else self._valid_idx.to(x.device)
            r = self._rows[key] = (idx, acc)
        return r

    def _cpu_reduce(self, xf, acc):
        """Σ|x| over rows and max |x| on CPU, in row chunks that stay in cache.

        Each chunk is copied into a reused float buffer, made absolute in place, summed (float32:
        row by row, the compiled reduction's order; float64: a GEMV) and max-reduced: the
        activation is read from memory once, and no large temporary is allocated (page faults of
        fresh buffers cost as much as the arithmetic).
        """
        torch = self._torch
        t, k = xf.shape
        rows = max(1, min(t, CPU_CHUNK_ELEMENTS // k))
        buf = self._cpu_buf.get(acc)
        if buf is None or buf.numel() < rows * k:
            buf = self._cpu_buf[acc] = torch.empty(rows * k, dtype=acc)
        ones = self._cpu_ones.get(acc)
        if acc != torch.float32 and (ones is None or ones.numel() < rows):  # the GEMV's (float64 only)
            ones = self._cpu_ones[acc] = torch.ones(rows, dtype=acc)
        s = torch.zeros(k, dtype=acc)
        maxima = []
        for i in range(0, t, rows):
            n = min(rows, t - i)
            a = buf[: n * k].view(n, k).copy_(xf[i : i + n]).abs_()
            if acc == torch.float32:
                # rows added in order, as the compiled reduction sums them: a GEMV's order is
                # MKL's choice (it differs between its AVX2 and AVX-512 kernels and thread counts)
                for row in a:
                    s.add_(row)
            else:
                s.addmv_(a.t(), ones[:n])
            maxima.append(a.amax())
        m = maxima[0] if len(maxima) == 1 else torch.stack(maxima).amax()
        return s, m

    def _make_hook(self, gi: int):
        torch = self._torch
        name = self.groups[gi].modules[0]

        def hook(module, args):
            if self.paused:
                return None
            x = args[0]
            if self._first_call[gi] is None:
                self._first_call[gi] = self._calls
                self._calls += 1
            if self._mask is None:
                raise RuntimeError("StatsCollector.set_mask() must be called before each forward pass")
            if tuple(x.shape[:-1]) != self._shape and not _same_rows(tuple(x.shape[:-1]), self._shape):
                raise UserError(
                    f"linear {name} sees input of shape {tuple(x.shape)}, not [batch, tokens, features] of the batch "
                    f"{self._shape}: padding cannot be excluded for it; this architecture's layout is not supported"
                )
            idx, acc = self._rows_for(x)
            with torch.no_grad():
                xf = x.detach().reshape(-1, x.shape[-1])
                if idx is not None:
                    xf = xf.index_select(0, idx)
                cpu = xf.device.type == "cpu"
                if cpu and acc == torch.float32 and xf.numel() >= COMPILED_MIN_ELEMENTS and _compiled_cpu_reduce() is not None:
                    s, m = _compiled_cpu_reduce()(xf)
                elif cpu:
                    s, m = self._cpu_reduce(xf, acc)
                elif self.gpu_reduction == "norm":
                    # GPU: fused |x| + float32 reductions, no temporary (TF32-proof, unlike a GEMV).
                    s = torch.linalg.vector_norm(xf, 1, dim=0, dtype=acc)
                    m = torch.linalg.vector_norm(xf, float("inf"))
                else:
                    a = xf.abs()
                    s = a.sum(0, dtype=acc)
                    m = a.amax()
                if self.keep_batches:
                    self._batches[gi].append(s.detach().to("cpu", copy=True))
                if self._sum[gi] is None:
                    self._sum[gi] = s.to(torch.float64)
                    self._amax[gi] = m.float()
                else:
                    self._sum[gi] += s
                    self._amax[gi] = torch.maximum(self._amax[gi], m.float())
            return None

        return hook

    def end_batch(self) -> None:
        """Count the batch's tokens and stop at the first layer that saw NaN/Inf activations."""
        self.check_finite()
        self.check_all_ran()
        self.num_tokens += self._batch_tokens
        self._mask = None

    def check_finite(self) -> None:
        """Stop at the first layer (in forward order) whose activations so far hold NaN/Inf."""
        gis = [gi for gi, a in enumerate(self._amax) if a is not None]
        bad = [gi for gi, ok in zip(gis, finite_each([self._amax[gi] for gi in gis])) if not ok]
        if bad:
            first = min(bad, key=lambda gi: self._first_call[gi])
            raise UserError(
                f"non-finite (NaN/Inf) activations reach {self.groups[first].modules[0]} (the first layer that saw them): "
                "the model's weights or dtype overflow; try --dtype float32 or check the checkpoint"
            )

    def check_all_ran(self) -> None:
        missing = [self.groups[gi].modules[0] for gi, s in enumerate(self._sum) if s is None]
        if missing:
            raise UserError(f"linear {missing[0]} never ran in the forward pass: the model does not use it; it cannot be calibrated")

    def group_amax(self, gi: int):
        """Group `gi`'s input amax so far (FP32 0-d, on its device; None before any batch)."""
        return self._amax[gi]

    def state(self) -> dict:
        """The accumulators so far, on the CPU (a resume point of the sequential pipeline)."""
        cpu = lambda xs: [None if x is None else x.detach().to("cpu", copy=True) for x in xs]  # noqa: E731
        return {"sum": cpu(self._sum), "amax": cpu(self._amax), "first_call": list(self._first_call), "calls": self._calls}

    def restore(self, state: dict, device) -> None:
        """Continue from `state` (of :meth:`state`), the accumulators on `device`: the same values,
        so the following additions give the bits an uninterrupted run gives."""
        on = lambda xs: [None if x is None else x.to(device) for x in xs]  # noqa: E731
        self._sum, self._amax = on(state["sum"]), on(state["amax"])
        self._first_call, self._calls = list(state["first_call"]), state["calls"]

    def parts(self) -> dict:
        """What a data-parallel rank hands rank 0: every batch's partial sums per group (needs
        ``keep_batches``), the groups' amax and the token count (`distributed.merge_stats`)."""
        return {
            "sums": self._batches,
            "amax": [None if a is None else a.to("cpu", self._torch.float32) for a in self._amax],
            "tokens": self.num_tokens,
        }

    def result(self) -> dict[str, dict]:
        """``{module: {"mean_abs": float32 [K], "amax": float32 0-d}}`` for every group member (CPU)."""
        torch = self._torch
        if self.num_tokens == 0:
            raise UserError("no valid tokens were seen: the samples are empty")
        out = {}
        for g, s, a in zip(self.groups, self._sum, self._amax):
            mean_abs = (s.to("cpu", torch.float64) / self.num_tokens).to(torch.float32).contiguous()
            amax = a.to("cpu", torch.float32).reshape(())
            for m in g.modules:
                out[m] = {"mean_abs": mean_abs.clone(), "amax": amax.clone()}
        return out


def collect(
    model, batches: list[dict], groups: list[Group], progress: Callable[[int, int], None] | None = None, kv=None, parts: bool = False,
    experts=None,
) -> tuple[dict, int]:
    """Run ``batches`` through ``model`` with the statistics hooks. Returns (stats, num_tokens).

    `kv`: a `kvcache.KVCollector` that also sees every batch (through the KV cache the forward
    pass then fills). `parts`: return `StatsCollector.parts()` (a data-parallel rank's share)
    instead of the statistics. `experts`: an installed `experts.ExpertCollector` that sees every
    batch too."""

    dev = input_device(model)
    kw = forward_kwargs(model)
    with StatsCollector(model, groups, keep_batches=parts) as col, torch.inference_mode():
        for b in batches:
            col.set_mask(b["attention_mask"])
            if experts is not None:
                experts.set_mask(b["attention_mask"])
            extra = {}
            if kv is not None and kv.problem is None:  # no cache for a model without k_proj / v_proj (MLA)
                kv.set_mask(b["attention_mask"])
                extra = kv.forward_kwargs()
            model(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev), **{**kw, **extra})
            col.end_batch()
            if experts is not None:
                experts.end_batch()
            if kv is not None and kv.problem is None:
                kv.end_batch()
            if progress is not None:
                progress(int(b["input_ids"].shape[0]), int(b["attention_mask"].sum()))
        if parts:
            return col.parts(), col.num_tokens
        return col.result(), col.num_tokens
