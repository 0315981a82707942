"""`pack`: stream a bf16 HF checkpoint into an NVFP4 / MXFP4 checkpoint with masks and K-Ext
extensions (SPEC §3–§7).

The whole output layout (every tensor's name, dtype and shape, and the shard split) follows
from the source's safetensors headers, the decision groups and their ratios (`build_layout`),
so `size` computes exact byte counts with the same function, headers are written first and
tensors stream to disk one at a time. Source tensors are read by offset (no mmap); a fused
group (q/k/v, gate/up) is read member by member wherever its shards are.

Reading, quantizing and writing overlap (`_stream`): reader threads fill a few reusable
buffers (pinned on CUDA) up to ``RESSERVE_PACK_DEPTH`` groups ahead (default 2), the calling
thread quantizes, and one writer thread writes the tensors in layout order, so the bytes are
those of one thread doing everything (depth 0 or 1 does exactly that). The peak memory is a
few groups' weights plus the runtime.

Atomic: everything is built in a hidden sibling ``.CKPT.tmp-<pid>-…`` directory, fsynced
and renamed at the end; a later run removes partial directories of dead processes.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from resserve_export import __version__
from resserve_export.algorithms.awq.smoothing import FILE as AWQ_FILE
from resserve_export.algorithms.awq.smoothing import Smoothing, file_digest
from resserve_export.core.errors import UserError
from resserve_export.core.names import EXT_SCALE_SUFFIX, EXT_WEIGHT_SUFFIX, MASK_SUFFIX
from resserve_export.core.outputs import check_out_dir, check_writable, write_dir_atomic
from resserve_export.core.ui import Progress
from resserve_export.formats import registry
from resserve_export.formats.constants import RATIOS
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.modeling import modelio
from resserve_export.modeling.experts import expert_blocks, routers
from resserve_export.modeling.groups import Group
from resserve_export.modeling.modelio import source_dtype
from resserve_export.stages.layout import OWN_FILES, WEIGHT_SUFFIXES, build_layout, model_groups, recorded_groups
from resserve_export.storage.checkpoint import (
    MODEL_INDEX,
    MODEL_PREFIX,
    SIDECAR_INDEX,
    SIDECAR_PREFIX,
    dump_json,
    resserve_section,
)
from resserve_export.storage.safetensors import ST_DTYPES, SafetensorsFiles, ShardedWriter, file_bytes, parse_size, unreadable

_GROUP_CACHE_BYTES = 1 << 30
THREADS_ENV = "RESSERVE_PACK_THREADS"  # intra-op threads for CPU quantization (default 1)
# The read / quantize / write pipeline of `_stream`: groups read ahead and quantized groups queued
# for the writer (0 or 1: one stage after another on one thread).
DEPTH_ENV = "RESSERVE_PACK_DEPTH"
_DEPTH = 2
_READ_AHEAD_BYTES = 1 << 30  # read slabs in all (at least two, each the largest group's size)
_READ_CHUNK = 16 << 20  # bytes per positioned read; a group's chunks are read in parallel
_READERS = 4  # reader threads (at most the CPU count)
_SLAB_ALIGN = 4096  # each weight starts at this alignment in its slab
_COPY_CHUNK = 16 << 20  # the writer's buffer for verbatim copies


# --------------------------------------------------------------------------------------------
# Inputs: calibration and ratios
# --------------------------------------------------------------------------------------------


def read_calibration(calib: Path, model_fingerprint: str, allow_other_weights: bool = False) -> dict:
    """calibration.json of `calib`, made from these exact weights (content fingerprint) unless
    `allow_other_weights`."""
    calib = Path(calib)
    meta_path, sal_path = calib / "calibration.json", calib / "salience.safetensors"
    if not meta_path.exists() or not sal_path.exists():
        raise UserError(f"{calib} is not a calibration directory (needs calibration.json and salience.safetensors): run `resserve-export calibrate` first")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError:
        raise UserError(f"{meta_path} is not valid JSON: re-run calibrate") from None
    if not isinstance(meta, dict):
        raise UserError(f"{meta_path} does not hold a calibration record: re-run calibrate")
    if not allow_other_weights:
        modelio.check_fingerprint(meta, model_fingerprint, f"calibration in {calib}")
    return meta


def load_calibration(
    calib: Path, model_fingerprint: str, groups: list[Group], allow_other_weights: bool = False
) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(calibration.json, {module: (mean_abs, amax)}) checked against the model.

    Every amax must be finite and positive (it becomes a scale).
    """
    calib = Path(calib)
    meta = read_calibration(calib, model_fingerprint, allow_other_weights)
    sal = SafetensorsFiles([calib / "salience.safetensors"])
    missing = [m for g in groups for m in g.modules if f"{m}.mean_abs" not in sal or f"{m}.amax" not in sal]
    if missing:
        more = f" and {len(missing) - 2} more" if len(missing) > 2 else ""
        raise UserError(f"calibration in {calib} has no statistics for {', '.join(missing[:2])}{more}: re-run calibrate on this model")
    stats = {}
    for g in groups:
        for m in g.modules:
            mean_abs, amax = sal.get(f"{m}.mean_abs").float(), sal.get(f"{m}.amax").float().reshape(())
            if mean_abs.shape != (g.in_features,):
                raise UserError(f"calibration {m}.mean_abs has shape {tuple(mean_abs.shape)}, expected ({g.in_features},): re-run calibrate")
            if not bool(torch.isfinite(amax)) or float(amax) <= 0 or not bool(torch.isfinite(mean_abs).all()):
                raise UserError(
                    f"calibration in {calib} has amax {float(amax)} for {m}: an input scale must be finite and positive; "
                    "re-run calibrate (with --dtype float32 if the model overflows)"
                )
            stats[m] = (mean_abs, amax)
    return meta, stats


def check_format_arg(fmt: str) -> registry.Format:
    """The format named `fmt`, or a `UserError` listing the choices."""
    try:
        return registry.get(fmt)
    except ValueError:
        raise UserError(f"unknown format {fmt!r}: choose one of {', '.join(registry.FORMATS)}") from None


def check_ratio_arg(ratio: float) -> float:
    if float(ratio) not in RATIOS:
        raise UserError(f"ratio {ratio} is not allowed: choose one of {', '.join(str(r) for r in RATIOS)}")
    return float(ratio)


def load_ratios(
    groups: list[Group],
    ratio: float | None,
    plan: Path | None,
    model_fingerprint: str | None,
    fmt: str | None = None,
    rounding: str | None = None,
    allow_other_weights: bool = False,
) -> tuple[dict[str, float], dict | None]:
    """({group name: ρ}, plan provenance or None) from ``--ratio`` or ``--plan``.

    A plan must come from scores of this model's weights (unless `allow_other_weights`) and of
    the format (and MXFP4 scale rounding) being packed.
    """
    if (ratio is None) == (plan is None):
        raise UserError("pass exactly one of --ratio R or --plan plan.json")
    if plan is None:
        r = check_ratio_arg(ratio)
        return {g.name: r for g in groups}, None
    from resserve_export.stages.plan import load_plan, module_ratios

    fp = None if allow_other_weights else model_fingerprint
    data = load_plan(Path(plan), fingerprint=fp, modules=[m for g in groups for m in g.modules])
    if fmt is not None:
        check_plan_format(data, Path(plan), fmt, rounding)
    per_module = module_ratios(data)
    out = {}
    for g in groups:
        rs = {per_module[m] for m in g.modules}
        if len(rs) > 1:
            raise UserError(f"plan {plan} gives fused members {', '.join(g.modules)} different ratios: they share one input, plan again")
        out[g.name] = rs.pop()
    prov = {k: data.get(k) for k in ("budget", "achieved_bits", "satisfied", "method") if k in data}
    return out, prov


def _check_recorded_format(what: str, recorded: str | None, recorded_rounding: str | None, fmt: str, rounding: str | None, redo: str) -> None:
    """Refuse what was computed for one format (`what`: a sentence with ``{fmt}``, e.g. a plan's
    scores or AWQ scales) when --format / --mx-scale differ."""
    if recorded != fmt:
        raise UserError(f"{what.format(fmt=recorded)} but --format is {fmt}: pack with --format {recorded}, or calibrate with --format {fmt}{redo}")
    if registry.get(fmt).has_rounding and recorded_rounding != rounding:
        raise UserError(
            f"{what.format(fmt=fmt.upper())} with scale rounding {recorded_rounding} but --mx-scale is {rounding}: "
            f"pack with --mx-scale {recorded_rounding}, or calibrate with --mx-scale {rounding}{redo}"
        )


def check_plan_format(plan: dict, path: Path, fmt: str, rounding: str | None) -> None:
    """Refuse a plan whose scores were computed for another format or MXFP4 scale rounding."""
    if plan.get("format") is None:
        raise UserError(f"plan {path} does not record the format its scores were computed for: re-run `resserve-export plan`")
    _check_recorded_format(f"plan {path} was made from {{fmt}} scores", plan["format"], plan.get("mx_scale_rounding"), fmt, rounding, " and plan again")


def check_awq_format(record: dict, calib: Path, fmt: str, rounding: str) -> None:
    """Refuse to pack AWQ scales searched for another format (or MXFP4 scale rounding): the
    search scored them under that format's arithmetic."""
    _check_recorded_format(f"the AWQ scales in {calib} were searched for {{fmt}}", record.get("format"), record.get("mx_scale_rounding"), fmt, rounding, "")


# --------------------------------------------------------------------------------------------
# Pack
# --------------------------------------------------------------------------------------------


@dataclass
class PackResult:
    out: Path
    model_files: int
    sidecar_files: int
    bytes_written: int
    seconds: float
    groups: int


def _copy_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name in OWN_FILES or p.name.endswith(WEIGHT_SUFFIXES):
            continue
        shutil.copyfile(p, dst / p.name)  # fsynced with the rest by write_dir_atomic
        copied.append(p.name)
    return copied


def pick_device(device: str) -> torch.device:
    """The quantization device for ``--device`` (checked by `modelio.parse_device`, as every command
    does): ``auto`` is the first CUDA GPU when there is one, else the CPU."""
    d = modelio.parse_device(device)
    if d == "auto":
        d = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(d)


def pack(
    model: str | os.PathLike,
    calib: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str = "nvfp4",
    *,
    ratio: float | None = None,
    plan: str | os.PathLike | None = None,
    mx_scale: str = "ceil",
    device: str = "auto",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: bool = True,
    allow_other_weights: bool = False,
    kv_cache: str = "none",
) -> PackResult:
    """Write the packed checkpoint directory to `out` (see the module docstring).

    `kv_cache` (``none``, ``fp8``, ``nvfp4``): also write each attention layer's k / v scales
    from the calibration's KV-cache statistics (`kvcache`), and declare the KV-cache format in
    the quantization config."""
    from resserve_export.formats import kv as kv_format

    t0 = time.perf_counter()
    f = check_format_arg(fmt)
    kv_format.check_for_format(kv_cache, f)  # before any work; build_layout relies on it too
    try:
        rounding = ScaleRounding(mx_scale)
    except ValueError:
        raise UserError(f"unknown --mx-scale {mx_scale!r}: choose one of {', '.join(r.value for r in ScaleRounding)}") from None
    if ratio is not None:
        check_ratio_arg(ratio)
    max_bytes = parse_size(max_shard_size)
    dev = pick_device(device)
    depth = pipeline_depth()
    out = Path(out).expanduser().absolute()
    check_out_dir(out, overwrite)
    model_dir = modelio.resolve_model(model)
    modelio.check_architecture(model_dir, "pack")
    source = SafetensorsFiles(modelio.weight_files(model_dir))
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise UserError(f"{model_dir} is already quantized ({cfg['quantization_config'].get('quant_method')}): pack needs a bf16/fp16 model")
    shapes = source.shapes()
    blocks = expert_blocks(shapes, "packed")
    fingerprint = modelio.fingerprint(model_dir)
    # The quantized linears and their fused groups are the ones calibrate found on the loaded
    # model (one rule), not re-derived from the headers.
    recorded = read_calibration(Path(calib), fingerprint, allow_other_weights).get("groups")
    groups = recorded_groups(recorded, shapes) if recorded else model_groups(shapes)
    calib_meta, stats = load_calibration(Path(calib), fingerprint, groups, allow_other_weights)
    smoothing = Smoothing.from_calibration(Path(calib), calib_meta, shapes)
    if smoothing is not None:
        check_awq_format(calib_meta["weight_algo"], Path(calib), fmt, rounding.value)
    ratios, plan_prov = load_ratios(
        groups, ratio, Path(plan) if plan is not None else None, fingerprint, fmt, rounding.value, allow_other_weights
    )
    # Drop lm_head only when the config says explicitly that it is tied: an extra copy costs
    # bytes, a missing one breaks the model.
    tied = cfg.get("tie_word_embeddings") is True
    layout = build_layout(shapes, groups, ratios, fmt, tied, kv_cache)
    kv_tensors = _kv_tensors(Path(calib), shapes, f, kv_cache)
    model_shards, side_shards = layout.shards(max_bytes)

    need = file_bytes(model_shards) + file_bytes(side_shards)
    check_writable(out, need_bytes=need)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out.parent}: {e.strerror or e}; choose another --out") from None

    provenance = {
        "producer": {"name": "resserve-export", "version": __version__},
        "model_fingerprint": fingerprint,
        "fingerprint_method": modelio.FINGERPRINT_METHOD,
        "source_dtype": source_dtype(shapes, [m for g in groups for m in g.modules], model_dir),
        "calibration": {k: calib_meta.get(k) for k in ("model", "dataset", "num_samples", "num_tokens", "seq_len", "seed")},
        "ratio": ratio if plan is None else None,
        "plan": plan_prov,
    }
    if smoothing is not None:
        # Only for smoothed checkpoints, so that round-to-nearest packs keep their bytes.
        provenance["weight_algo"] = {
            "name": "awq",
            "smoothed_groups": len(smoothing.folds),
            "scales_sha256": file_digest(Path(calib) / calib_meta["weight_algo"].get("file", AWQ_FILE)),
        }
    # Routers stay in bf16: named so that no loader quantizes them.
    ignore = ["lm_head", *routers(shapes, blocks)]
    qc = f.quantization_config(ignore, __version__, kv_cache)
    qc["resserve"] = resserve_section(fmt, rounding.value, layout.groups, provenance, kv_cache)
    new_cfg = dict(cfg)
    new_cfg["quantization_config"] = qc

    threads = torch.get_num_threads()

    def write(tmp: Path) -> None:
        mw = ShardedWriter(tmp, MODEL_PREFIX, model_shards)
        sw = ShardedWriter(tmp, SIDECAR_PREFIX, side_shards)
        try:
            _stream(layout, SmoothedSource(source, smoothing), stats, ratios, fmt, rounding, dev, mw, sw, progress, kv_tensors, depth)
            mw.close()
            sw.close()
        except BaseException:
            mw.abort()
            sw.abort()
            raise
        # write_dir_atomic fsyncs every file of tmp before the rename.
        (tmp / MODEL_INDEX).write_text(dump_json(mw.index()))
        if side_shards:
            (tmp / SIDECAR_INDEX).write_text(dump_json(sw.index()))
        _copy_files(model_dir, tmp)
        for name, obj in f.extra_files(ignore, __version__, kv_cache).items():
            (tmp / name).write_text(dump_json(obj))
        (tmp / "config.json").write_text(dump_json(new_cfg))

    try:
        if dev.type == "cpu":
            # One intra-op thread: the compiled quantizer runs one short OpenMP region per chunk,
            # and with several threads each region waits for the slowest one, which on a shared
            # CPU can be descheduled (measured on 2 busy cores: 1 thread 0.14 s, 2 threads 0.5-5 s
            # for a 9728x2560 bf16 weight). Reading the next group overlaps on another thread.
            torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
        write_dir_atomic(out, write, overwrite)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise UserError(
                f"no space left on the device while writing {out.name} (it needs about {need / 1e9:.2f} GB): "
                "free space or choose another --out; nothing was written"
            ) from None
        raise UserError(f"writing {out} failed: {e.strerror or e}; nothing was written") from None
    finally:
        torch.set_num_threads(threads)
    written = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return PackResult(out, len(model_shards), len(side_shards), written, time.perf_counter() - t0, len(groups))


def _kv_tensors(calib: Path, shapes, f: registry.Format, kv_cache: str) -> dict[str, torch.Tensor]:
    """{name: stored scale} of the KV-cache scales (empty for ``none``): amax / 448 of the
    calibration's per-layer key and value amax (see `kvcache`)."""
    from resserve_export.formats import kv as kv_format
    from resserve_export.modeling import attention as attention_layers
    from resserve_export.storage import kv_stats as kv_file

    if kv_cache == "none":
        return {}
    attention = attention_layers.attention_modules(shapes)
    amax = kv_file.load(calib, attention)
    shape = kv_format.scale_shape(f.kv_style)
    out = {}
    for a in attention:
        for name, x in zip(kv_format.scale_names(a, f.kv_style), amax[a]):
            out[name] = kv_format.scale_from_amax(x).reshape(shape).contiguous()
    return out


class SmoothedSource:
    """The source tensors as the checkpoint stores them: with a calibration's AWQ `Smoothing`
    applied to the weights, norms and biases it changes (`awq.Smoothing.apply`), else as read."""

    def __init__(self, source: SafetensorsFiles, smoothing: Smoothing | None):
        self.source, self.smoothing = source, smoothing
        self.entries = source.entries

    def changes(self, name: str) -> bool:
        return self.smoothing is not None and self.smoothing.affects(name)

    def get(self, name: str) -> torch.Tensor:
        t = self.source.get(name)
        return self.smoothing.apply(name, t) if self.changes(name) else t


def pipeline_depth() -> int:
    """The pack pipeline's depth: ``RESSERVE_PACK_DEPTH``, else `_DEPTH`."""
    raw = os.environ.get(DEPTH_ENV, "").strip()
    if not raw:
        return _DEPTH
    try:
        depth = int(raw)
    except ValueError:
        depth = -1
    if depth < 0:
        raise UserError(f"{DEPTH_ENV}={raw!r} is not a whole number ≥ 0: unset it, or set 0 to read, quantize and write one after another")
    return depth


class _Slab:
    """One reusable read buffer (pinned on CUDA) holding a group's weights, and the CUDA event
    after which its last host-to-device copy is done (None: free to overwrite)."""

    def __init__(self, nbytes: int, pin: bool):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.event = None


class _Reader:
    """Reads groups' weights into slabs with positioned reads of `_READ_CHUNK` bytes.

    With `threads` > 0 the chunks are read by that many threads (a group's chunks in parallel,
    groups in order); with 0 they are read by the caller when submitted. Only the calling
    thread takes and returns slabs, so reader threads never wait for memory."""

    def __init__(self, source, slab_bytes: int, slabs: int, pin: bool, threads: int):
        from concurrent.futures import ThreadPoolExecutor

        self.source, self.slab_bytes, self.slabs, self.pin = source, slab_bytes, slabs, pin
        self.free: list[_Slab] = []
        self.made = 0
        self.fds: dict[Path, int] = {}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="pack-read") if threads > 0 else None

    def take(self) -> _Slab | None:
        if self.free:
            return self.free.pop()
        if self.made < self.slabs:
            self.made += 1
            return _Slab(self.slab_bytes, self.pin)
        return None

    def give(self, slab: _Slab, event=None) -> None:
        slab.event = event
        self.free.append(slab)

    def _fd(self, e) -> int:
        fd = self.fds.get(e.path)
        if fd is None:
            fd = self.fds[e.path] = os.open(e.path, os.O_RDONLY)
        return fd

    def submit(self, g: Group, slab: _Slab) -> tuple[list, list]:
        """([(module, entry, view)], [futures or None]) of `g` read into `slab`."""
        members, jobs = [], []
        off = 0
        for m in g.modules:
            name = f"{m}.weight"
            e = self.source.entries[name]
            try:
                fd = self._fd(e)
            except OSError as err:
                raise unreadable(name, e.path.name, err.strerror or str(err)) from None
            view = slab.buf[off : off + e.nbytes]
            members.append((m, e, view))
            for a in range(0, e.nbytes, _READ_CHUNK):
                args = (fd, name, e, view, a, min(a + _READ_CHUNK, e.nbytes), slab.event)
                jobs.append(self.pool.submit(_read_chunk, *args) if self.pool is not None else _read_chunk(*args))
            off += -(-e.nbytes // _SLAB_ALIGN) * _SLAB_ALIGN
        return members, jobs

    def weights(self, members: list, jobs: list) -> dict[str, torch.Tensor]:
        """{module: weight} of a submitted group once read, as the checkpoint stores it (AWQ
        smoothing applied)."""
        for j in jobs:
            if j is not None:
                j.result()
        out = {}
        for m, e, view in members:
            w = view.view(ST_DTYPES[e.dtype][0]).reshape(e.shape)
            name = f"{m}.weight"
            out[m] = self.source.smoothing.apply(name, w) if self.source.changes(name) else w
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _read_chunk(fd: int, name: str, e, view: torch.Tensor, a: int, b: int, event) -> None:
    """Bytes [a, b) of tensor `name` into ``view[a:b]`` (after `event`: the slab's last copy)."""
    if event is not None:
        event.synchronize()
    mv = memoryview(view.numpy())[a:b]
    done = 0
    while done < b - a:
        try:
            got = os.preadv(fd, [mv[done:]], e.start + a + done)
        except OSError as err:
            raise unreadable(name, e.path.name, err.strerror or str(err)) from None
        if got == 0:
            raise unreadable(name, e.path.name, "the file is truncated")
        done += got


class _Writer:
    """Runs write jobs in submission order on one thread (``pack-write``); with `depth` 0 runs
    them at once on the caller's thread.

    At most `depth` quantized groups wait for it (their outputs are memory); copies of source
    tensors hold no memory and do not count. The first error a job raises stops the later jobs
    and is raised to the caller at its next `put` or at `finish`."""

    def __init__(self, depth: int):
        import queue
        import threading

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


def _stream(layout, source, stats, ratios, fmt, rounding, dev, mw, sw, progress, kv_tensors=None, depth: int | None = None) -> None:
    """Produce every output tensor in layout order, in three overlapping stages.

    - read: the weights of up to `depth` groups ahead are read into reusable slabs (pinned host
      memory on CUDA) by up to `_READERS` threads, in positioned chunks;
    - quantize: this thread, one group at a time (on CUDA on a side stream: the host-to-device
      copies are asynchronous, the slab is handed back to the readers once they are done, and the
      outputs are copied asynchronously into pinned host memory);
    - write: one thread writes tensors in layout order (the same order and bytes as one thread
      doing everything), and copies the unquantized tensors from the source itself.

    Memory: at most min(`depth` + 1, max(2, `_READ_AHEAD_BYTES` / largest group)) slabs of the
    largest group's size, plus `depth` groups' outputs waiting for the writer (about a quarter of
    their weights). `depth` (default `pipeline_depth()`) 0 or 1 runs the stages one after another
    on this thread, with one slab. Errors of any stage are raised here; the other stages stop
    before this returns.
    """
    from resserve_export.algorithms.kext import extend_weight
    from resserve_export.algorithms.selection import select_mask
    from resserve_export.formats import ops as formats

    depth = pipeline_depth() if depth is None else depth
    piped = depth >= 2
    cuda = dev.type == "cuda"

    def group_bytes(g: Group) -> int:
        return sum(source.entries[f"{m}.weight"].nbytes for m in g.modules)

    def slab_bytes(g: Group) -> int:
        return sum(-(-source.entries[f"{m}.weight"].nbytes // _SLAB_ALIGN) * _SLAB_ALIGN for m in g.modules)

    sizes = {"copy": lambda n: source.entries[n].nbytes, "group": group_bytes, "kv": lambda n: 0}
    total_bytes = sum(sizes[kind](n) for kind, n in layout.items)
    groups = [(i, g) for i, (kind, g) in enumerate(layout.items) if kind == "group"]
    # Too large to hold: _pack_group reads the members one at a time.
    loaded = {i for i, g in groups if group_bytes(g) <= _GROUP_CACHE_BYTES}
    largest = max((slab_bytes(g) for i, g in groups if i in loaded), default=0)
    ahead = depth if piped else 0
    slabs = min(ahead + 1, max(2, _READ_AHEAD_BYTES // max(largest, 1))) if piped else 1
    readers = max(1, min(_READERS, os.cpu_count() or 1)) if piped else 0
    reader = _Reader(source, largest, slabs, cuda, readers)
    writer = _Writer(depth if piped else 0)
    stream = torch.cuda.Stream(dev) if cuda else None
    copy_buffer = bytearray(_COPY_CHUNK)
    pending: list = []  # (layout index, slab, members, jobs) in order
    upcoming = iter(groups)
    waiting: list = []  # a group taken from `upcoming` that had no free slab yet

    def top_up() -> None:
        while len(pending) < max(1, ahead):
            nxt = waiting.pop() if waiting else next(upcoming, None)
            if nxt is None:
                return
            i, g = nxt
            if i not in loaded:
                pending.append((i, None, None, None))
                continue
            slab = reader.take()
            if slab is None:
                waiting.append(nxt)
                return
            try:
                members, jobs = reader.submit(g, slab)
            except BaseException:
                reader.give(slab)
                raise
            pending.append((i, slab, members, jobs))

    def copy(name: str) -> None:
        if source.changes(name):
            mw.write(name, source.get(name))  # a norm (or bias) the AWQ scales fold into
            return
        e = source.entries[name]
        try:
            fd = os.open(e.path, os.O_RDONLY)
        except OSError as err:
            raise unreadable(name, e.path.name, err.strerror or str(err)) from None
        try:
            mw.copy_from(name, fd, e.start, copy_buffer, e.path.name)
        finally:
            os.close(fd)

    def write_outputs(outs: list, event) -> None:
        if event is not None:
            event.synchronize()
        for w, name, t in outs:
            w.write(name, t)

    try:
        with Progress("pack", total_bytes, unit="bytes", enabled=progress) as bar:
            n = len(layout.items)
            for i, (kind, item) in enumerate(layout.items):
                if kind == "copy":
                    bar.describe(f"{i + 1}/{n} {item[-40:]}")
                    writer.put(functools.partial(copy, item))
                    bar.advance(source.entries[item].nbytes)
                    continue
                if kind == "kv":
                    writer.put(functools.partial(mw.write, item, kv_tensors[item]))
                    continue
                g: Group = item
                bar.describe(f"{i + 1}/{n} {g.modules[0][-40:]}")
                top_up()
                j, slab, members, jobs = pending.pop(0)
                assert j == i, (j, i)
                if piped:
                    top_up()  # into the slabs still free while this group is quantized
                weights = reader.weights(members, jobs) if slab is not None else None
                outs: list = []
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    if cuda and slab is not None:
                        # The slab is free again once these copies are done: the readers wait
                        # for this event, not for the quantization.
                        weights = {m: w.to(dev, non_blocking=True) for m, w in weights.items()}
                        release = torch.cuda.Event()
                        release.record(stream)
                        reader.give(slab, release)
                        slab = None
                        if piped:
                            top_up()
                    _pack_group(
                        g, weights, source, stats, ratios[g.name], fmt, rounding, dev,
                        _Outputs(mw, outs), _Outputs(sw, outs), formats, extend_weight, select_mask,
                    )
                    done = None
                    if cuda:
                        done = torch.cuda.Event()
                        done.record(stream)
                del weights
                if slab is not None:  # on the CPU the weights were views of it
                    reader.give(slab)
                if piped:
                    top_up()
                writer.put(functools.partial(write_outputs, outs, done), group=True)
                del outs
                bar.advance(group_bytes(g))
            writer.finish()
    except BaseException:
        writer.cancel()
        raise
    finally:
        reader.close()


def _pack_group(g, weights, source, stats, ratio, fmt, rounding, dev, mw, sw, formats, extend_weight, select_mask) -> None:
    """Quantize group `g` and write its tensors through `mw` / `sw`. `weights`: {module: weight}
    on any device (already on `dev` saves a copy), or None to read the members one at a time."""
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
        q = formats.quantize(w, f, alpha=alpha, rounding=rounding)
        for suffix, t in f.base_tensors(q, input_scale):
            mw.write(f"{m}.{suffix}", t)
        if mask is not None:
            sw.write(f"{m}.{MASK_SUFFIX}", mask)
            ext = extend_weight(w, mask.to(dev), ratio, f, rounding, alpha=alpha)
            if ext is not None:
                sw.write(f"{m}.{EXT_WEIGHT_SUFFIX}", ext.codes)
                sw.write(f"{m}.{EXT_SCALE_SUFFIX}", ext.scales)
        del w, q


__all__ = ["pack", "build_layout", "model_groups", "Layout", "PackResult", "load_ratios", "load_calibration"]
