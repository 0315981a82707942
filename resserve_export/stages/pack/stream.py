"""`pack`'s streamed read - quantize - write pipeline: every output tensor produced in layout
order, in three overlapping stages.

- read: the weights of up to `depth` groups ahead are read into reusable slabs (pinned host
  memory on CUDA) by up to `READERS` threads, in positioned chunks (`storage.reader.SlabReader`);
- quantize: the calling thread, one group at a time (`pack_group`; on CUDA on a side stream: the
  host-to-device copies are asynchronous, the slab is handed back to the readers once they are
  done, and the outputs are copied asynchronously into pinned host memory);
- write: one thread (``pack-write``) writes tensors in layout order (the same order and bytes as
  one thread doing everything), and copies the unquantized tensors from the source itself.

The tensor layout of the output is described in docs/formats.md (masks, the extended weight).
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading

import torch

from resserve_export.algorithms import gptq
from resserve_export.algorithms.awq.smoothing import Smoothing
from resserve_export.algorithms.kext import extend_weight
from resserve_export.algorithms.selection import select_mask
from resserve_export.core.errors import UserError
from resserve_export.core.names import EXT_SCALE_SUFFIX, EXT_WEIGHT_SUFFIX, MASK_SUFFIX
from resserve_export.core.ui import Progress
from resserve_export.formats import ops as formats
from resserve_export.formats import registry
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.modeling.groups import Group
from resserve_export.stages.pack.inputs import pipeline_depth
from resserve_export.storage import fused_experts, hub_experts
from resserve_export.storage.safetensors import SafetensorsFiles, unreadable
from resserve_export.storage.reader import SlabReader, slab_bytes

GROUP_CACHE_BYTES = 1 << 30  # a larger group is read member by member by `pack_group`
READ_AHEAD_BYTES = 1 << 30  # read slabs in all (at least two, each the largest group's size)
READERS = 4  # reader threads (at most the CPU count)
COPY_CHUNK = 16 << 20  # the writer's buffer for verbatim copies


class SmoothedSource:
    """The source tensors as the checkpoint stores them: with a calibration's AWQ `Smoothing`
    applied to the weights, norms and biases it changes (`awq.Smoothing.apply`), else as read;
    and with its GPTQ weights (`gptq.Stored`), the quantized linears GPTQ chose."""

    def __init__(self, source: SafetensorsFiles, smoothing: Smoothing | None, quantized: gptq.Stored | None = None):
        self.source, self.smoothing, self.quantized = source, smoothing, quantized
        self.entries = source.entries

    def gptq(self, module: str, shape: tuple[int, int], alpha: torch.Tensor | None, dev: torch.device) -> FP4Tensor | None:
        """The calibration's GPTQ tensor of `module` on `dev` (None without GPTQ), checked to have
        the tensor scale `alpha` that `pack` computes from the weights it reads."""
        q = None if self.quantized is None else self.quantized.get(module, shape)
        if q is None:
            return None
        if alpha is not None and not torch.equal(q.global_scale.reshape(()).view(torch.int32), alpha.reshape(()).to("cpu").view(torch.int32)):
            raise UserError(
                f"the GPTQ weights of {module} were quantized with another tensor scale than these weights give: "
                "pack the model the calibration was made from"
            )
        return FP4Tensor(q.fmt, q.codes.to(dev), q.scales.to(dev), None if alpha is None else alpha.to(dev))

    def changes(self, name: str) -> bool:
        return self.smoothing is not None and self.smoothing.affects(name)

    def apply(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t`, the tensor `name` as read, as the checkpoint stores it."""
        return self.smoothing.apply(name, t) if self.changes(name) else t

    def get(self, name: str) -> torch.Tensor:
        return self.apply(name, self.source.get(name))


class _Writer:
    """Runs write jobs in submission order on one thread (``pack-write``); with `depth` 0 runs
    them at once on the caller's thread.

    At most `depth` quantized groups wait for it (their outputs are memory); copies of source
    tensors hold no memory and do not count. The first error a job raises stops the later jobs
    and is raised to the caller at its next `put` or at `finish`."""

    def __init__(self, depth: int):
        self.depth = depth
        self.error: BaseException | None = None
        if depth:
            self.jobs: queue.Queue = queue.Queue()
            self.slots = threading.Semaphore(depth)
            self.stopped = threading.Event()
            self.thread = threading.Thread(target=self._run, name="pack-write", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, holds_slot = job
            try:
                if self.error is None and not self.stopped.is_set():
                    fn()
            except BaseException as e:  # raised to the caller by _check
                self.error = e
            finally:
                del fn, job
                if holds_slot:
                    self.slots.release()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, fn, group: bool = False) -> None:
        if not self.depth:
            fn()
            return
        if group:
            while not self.slots.acquire(timeout=0.1):
                self._check()
        self._check()
        self.jobs.put((fn, group))

    def finish(self) -> None:
        """Wait for every job; raise the first error."""
        if self.depth:
            self.jobs.put(None)
            self.thread.join()
            self._check()

    def cancel(self) -> None:
        """Skip the jobs not started yet and wait for the running one (nothing writes after)."""
        if self.depth:
            self.stopped.set()
            self.jobs.put(None)
            self.thread.join()


class _Outputs:
    """Collects one group's output tensors for one `ShardedWriter` in write order; CUDA tensors
    start their copy into pinned host memory at once (completed when the group's event is)."""

    def __init__(self, writer, into: list):
        self.writer, self.into = writer, into

    def write(self, name: str, t: torch.Tensor) -> None:
        if t.is_cuda:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            t = h
        self.into.append((self.writer, name, t))


def _weight_names(g: Group) -> list[str]:
    return [f"{m}.weight" for m in g.modules]


def _write_outputs(outs: list, event) -> None:
    if event is not None:
        event.synchronize()
    for w, name, t in outs:
        w.write(name, t)


class _Pipeline:
    """One run of `stream`: the reader, the writer and the groups read ahead.

    Memory: at most min(`depth` + 1, max(2, `READ_AHEAD_BYTES` / largest group)) slabs of the
    largest group's size, plus `depth` groups' outputs waiting for the writer (about a quarter of
    their weights). `depth` 0 or 1 runs the stages one after another on the calling thread, with
    one slab."""

    def __init__(self, layout, source: SmoothedSource, stats, ratios, fmt, rounding, dev: torch.device, mw, sw, depth: int):
        self.source, self.stats, self.ratios, self.fmt, self.rounding = source, stats, ratios, fmt, rounding
        self.dev, self.mw, self.sw = dev, mw, sw
        self.written_fused = layout.written_fused
        # Experts in the hub's layout: one layer's quantized experts held until its last one.
        self.hub = hub_experts.HubWriter(layout.hub_experts) if layout.hub_experts else None
        self.piped = depth >= 2
        self.cuda = dev.type == "cuda"
        groups = [(i, g) for i, (kind, g) in enumerate(layout.items) if kind == "group"]
        # Too large to hold: pack_group reads the members one at a time.
        self.loaded = {i for i, g in groups if self.group_bytes(g) <= GROUP_CACHE_BYTES}
        largest = max((slab_bytes(source, _weight_names(g)) for i, g in groups if i in self.loaded), default=0)
        self.ahead = depth if self.piped else 0
        slabs = min(self.ahead + 1, max(2, READ_AHEAD_BYTES // max(largest, 1))) if self.piped else 1
        readers = max(1, min(READERS, os.cpu_count() or 1)) if self.piped else 0
        self.reader = SlabReader(source, largest, slabs, pin=self.cuda, threads=readers, thread_name="pack-read")
        self.writer = _Writer(depth if self.piped else 0)
        self.stream = torch.cuda.Stream(dev) if self.cuda else None
        self.copy_buffer = bytearray(COPY_CHUNK)
        self.pending: list = []  # (layout index, `Reading` or None) in order
        self.upcoming = iter(groups)
        self.waiting: list = []  # a group taken from `upcoming` that had no free slab yet

    def group_bytes(self, g: Group) -> int:
        return sum(self.source.entries[n].nbytes for n in _weight_names(g))

    def item_bytes(self, kind: str, item) -> int:
        """Source bytes of a layout item (what the progress bar counts)."""
        if kind == "copy":
            return self.source.entries[item].nbytes
        return self.group_bytes(item) if kind == "group" else 0

    def top_up(self) -> None:
        """Start reading the next groups, while fewer than the read-ahead are pending and a slab
        is free."""
        while len(self.pending) < max(1, self.ahead):
            nxt = self.waiting.pop() if self.waiting else next(self.upcoming, None)
            if nxt is None:
                return
            i, g = nxt
            if i not in self.loaded:
                self.pending.append((i, None))
                continue
            slab = self.reader.take()
            if slab is None:
                self.waiting.append(nxt)
                return
            try:
                reading = self.reader.submit(_weight_names(g), slab)
            except BaseException:
                self.reader.give(slab)
                raise
            self.pending.append((i, reading))

    def copy(self, name: str) -> None:
        """Write the source tensor `name` unquantized (runs on the writer)."""
        e = self.source.entries[name]
        if self.source.changes(name) or e.part is not None:
            # A norm (or bias) the AWQ scales fold into, or a part of a tensor stored fused.
            self.mw.write(name, self.source.get(name))
            return
        try:
            fd = os.open(e.path, os.O_RDONLY)
        except OSError as err:
            raise unreadable(name, e.path.name, err.strerror or str(err)) from None
        try:
            self.mw.copy_from(name, fd, e.start, self.copy_buffer, e.path.name)
        finally:
            os.close(fd)

    def weights(self, g: Group, reading) -> dict[str, torch.Tensor] | None:
        """{module: weight} of a submitted group once read, as the checkpoint stores it (AWQ
        smoothing applied); None for a group read member by member."""
        if reading is None:
            return None
        read = self.reader.wait(reading)
        return {m: self.source.apply(f"{m}.weight", read[f"{m}.weight"]) for m in g.modules}

    def group(self, i: int, g: Group) -> None:
        """Quantize group `g` (layout index `i`, `pack_group`) and queue its outputs for the
        writer."""
        self.top_up()
        j, reading = self.pending.pop(0)
        assert j == i, (j, i)
        if self.piped:
            self.top_up()  # into the slabs still free while this group is quantized
        slab = reading.slab if reading is not None else None
        weights = self.weights(g, reading)
        outs: list = []
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            if self.cuda and slab is not None:
                # The slab is free again once these copies are done: the readers wait for this
                # event, not for the quantization.
                weights = {m: w.to(self.dev, non_blocking=True) for m, w in weights.items()}
                release = torch.cuda.Event()
                release.record(self.stream)
                self.reader.give(slab, release)
                slab = None
                if self.piped:
                    self.top_up()
            mw = _Outputs(self.mw, outs)
            if self.hub is not None:
                mw = self.hub.into(mw)
            elif self.written_fused:
                mw = fused_experts.FusedWriter(mw)
            pack_group(g, weights, self.source, self.stats, self.ratios[g.name], self.fmt, self.rounding, self.dev, mw, _Outputs(self.sw, outs))
            done = None
            if self.cuda:
                done = torch.cuda.Event()
                done.record(self.stream)
        del weights
        if slab is not None:  # on the CPU the weights were views of it
            self.reader.give(slab)
        if self.piped:
            self.top_up()
        self.writer.put(functools.partial(_write_outputs, outs, done), group=True)

    def close(self) -> None:
        self.reader.close()


def stream(layout, source: SmoothedSource, stats, ratios, fmt, rounding, dev, mw, sw, progress, kv_tensors=None, depth: int | None = None) -> None:
    """Produce every output tensor of `layout` in order through `mw` (model shards) and `sw`
    (sidecar shards), reading `source`, with the pipeline of the module docstring. `depth`
    (default `inputs.pipeline_depth()`): groups read ahead and quantized groups queued for the
    writer. Errors of any stage are raised here; the other stages stop before this returns."""
    depth = pipeline_depth() if depth is None else depth
    p = _Pipeline(layout, source, stats, ratios, fmt, rounding, dev, mw, sw, depth)
    total_bytes = sum(p.item_bytes(kind, item) for kind, item in layout.items)
    try:
        with Progress("pack", total_bytes, unit="bytes", enabled=progress) as bar:
            n = len(layout.items)
            for i, (kind, item) in enumerate(layout.items):
                if kind == "copy":
                    bar.describe(f"{i + 1}/{n} {item[-40:]}")
                    p.writer.put(functools.partial(p.copy, item))
                    bar.advance(source.entries[item].nbytes)
                    continue
                if kind == "kv":
                    p.writer.put(functools.partial(mw.write, item, kv_tensors[item]))
                    continue
                g: Group = item
                bar.describe(f"{i + 1}/{n} {g.modules[0][-40:]}")
                p.group(i, g)
                bar.advance(p.group_bytes(g))
            if p.hub is not None:
                p.hub.finish()
            p.writer.finish()
    except BaseException:
        p.writer.cancel()
        raise
    finally:
        p.close()


def pack_group(g, weights, source, stats, ratio, fmt, rounding, dev, mw, sw) -> None:
    """Quantize group `g` and write its tensors through `mw` / `sw`: the base tensors of the
    format, and with a mask its extension (docs/formats.md, "Channel selection and masks" and
    "The extended weight (K-Ext)"). `weights`: {module: weight} on any device (already on `dev`
    saves a copy), or None to read the members one at a time."""
    f = registry.get(fmt)
    amax_x = torch.stack([stats[m][1] for m in g.modules]).max()
    mask = select_mask(stats[g.modules[0]][0], ratio) if ratio > 0 else None

    def weight(m: str) -> torch.Tensor:
        return weights[m] if weights is not None else source.get(f"{m}.weight")

    # One tensor scale for the fused group (NVFP4's weight_scale_2), None without one.
    alpha = f.weight_alpha(weight(m) for m in g.modules)
    if alpha is not None:
        alpha = alpha.to(dev)
        if not bool(torch.isfinite(alpha)):
            raise UserError(
                f"{' / '.join(g.modules)}: the weights hold NaN or Inf values ({f.tensor_scale_name} {float(alpha)}): fix the source checkpoint"
            )
    else:
        for m in g.modules:
            lo, hi = torch.aminmax(weight(m))
            if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
                raise UserError(f"{m}: the weight holds NaN or Inf values: fix the source checkpoint")
    input_scale = f.input_alpha(amax_x)
    for m in g.modules:
        w = weight(m).to(dev, non_blocking=True)
        q = source.gptq(m, tuple(w.shape), alpha, dev)
        if q is None:
            q = formats.quantize(w, f, alpha=alpha, rounding=rounding)
        else:
            w = q.dequantize()  # the extension selects columns of the weights GPTQ chose
        for suffix, t in f.base_tensors(q, input_scale):
            mw.write(f"{m}.{suffix}", t)
        if mask is not None:
            sw.write(f"{m}.{MASK_SUFFIX}", mask)
            ext = extend_weight(w, mask.to(dev), ratio, f, rounding, alpha=alpha)
            if ext is not None:
                sw.write(f"{m}.{EXT_WEIGHT_SUFFIX}", ext.codes)
                sw.write(f"{m}.{EXT_SCALE_SUFFIX}", ext.scales)
        del w, q


__all__ = ["SmoothedSource", "stream", "pack_group", "GROUP_CACHE_BYTES", "READ_AHEAD_BYTES", "READERS", "COPY_CHUNK"]
