"""`pack`: stream a bf16 HF checkpoint into an NVFP4 / MXFP4 checkpoint with masks and K-Ext
extensions (the formats and tensors are described in docs/formats.md).

The whole output layout (every tensor's name, dtype and shape, and the shard split) follows
from the source's safetensors headers, the decision groups and their ratios (`build_layout`),
so `size` computes exact byte counts with the same function, headers are written first and
tensors stream to disk one at a time. Source tensors are read by offset (no mmap); a fused
group (q/k/v, gate/up) is read member by member wherever its shards are.

The inputs (calibration, ratio or plan, format arguments) are read and checked first
(`inputs`). Reading, quantizing and writing then overlap (`stream`): reader threads fill a few
reusable buffers (pinned on CUDA) up to ``RESSERVE_PACK_DEPTH`` groups ahead (default 2), the
calling thread quantizes, and one writer thread writes the tensors in layout order, so the bytes
are those of one thread doing everything (depth 0 or 1 does exactly that). The peak memory is a
few groups' weights plus the runtime.

Atomic: everything is built in a hidden sibling ``.CKPT.tmp-<pid>-…`` directory, fsynced
and renamed at the end; a later run removes partial directories of dead processes.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from resserve_export import __version__
from resserve_export.algorithms import gptq
from resserve_export.algorithms.awq.smoothing import FILE as AWQ_FILE
from resserve_export.algorithms.awq.smoothing import file_digest
from resserve_export.core.errors import UserError
from resserve_export.core.outputs import check_out_dir, check_writable, write_dir_atomic
from resserve_export.modeling import families, modelio
from resserve_export.modeling.experts import routers
from resserve_export.modeling.groups import exact_linears
from resserve_export.modeling.modelio import source_dtype
from resserve_export.stages.layout import OWN_FILES, WEIGHT_SUFFIXES, build_layout
from resserve_export.stages.pack.inputs import PackArgs, PackInputs, check_args, kv_tensors, read_inputs
from resserve_export.stages.pack.stream import SmoothedSource, stream
from resserve_export.storage.checkpoint import (
    MODEL_INDEX,
    MODEL_PREFIX,
    SIDECAR_INDEX,
    SIDECAR_PREFIX,
    dump_json,
    resserve_section,
)
from resserve_export.storage.hub_experts import HUB
from resserve_export.storage.safetensors import ShardedWriter, file_bytes

THREADS_ENV = "RESSERVE_PACK_THREADS"  # intra-op threads for CPU quantization (default 1)


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
    experts_layout: str = "per-expert",
) -> PackResult:
    """Write the packed checkpoint directory to `out` (see the module docstring).

    `kv_cache` (``none``, ``fp8``, ``nvfp4``): also write each attention layer's k / v scales
    from the calibration's KV-cache statistics (`storage.kv_stats`), and declare the KV-cache
    format in the quantization config.

    `experts_layout` ``hub`` (gpt-oss, ``mxfp4``, ratio 0): the experts are written as the
    hub's MXFP4 blocks and scales, one set of four tensors per layer (`storage.hub_experts`),
    everything else, the attention linears included, is copied as it is, and config.json gets
    the hub's quantization_config (``quant_method: mxfp4``) with our ``resserve`` section: stock
    vLLM's ``gpt_oss_mxfp4`` method loads it, expert biases included."""
    t0 = time.perf_counter()
    args = check_args(fmt, kv_cache, mx_scale, ratio, max_shard_size, device, experts_layout, plan)
    out = Path(out).expanduser().absolute()
    check_out_dir(out, overwrite)
    calib = Path(calib)
    inputs = read_inputs(
        model, calib, fmt, args.rounding.value, ratio, Path(plan) if plan is not None else None, allow_other_weights, args.experts_layout
    )
    try:
        hub = args.experts_layout == HUB
        # Drop lm_head only when the config says explicitly that it is tied: an extra copy costs
        # bytes, a missing one breaks the model.
        tied = inputs.config.get("tie_word_embeddings") is True
        layout = build_layout(
            inputs.shapes, inputs.groups, inputs.ratios, fmt, tied, kv_cache, families.writes_fused_experts(inputs.config) and not hub,
            args.experts_layout,
        )
        kv = kv_tensors(calib, inputs.shapes, args.format, kv_cache)
        model_shards, side_shards = layout.shards(args.max_bytes)

        need = file_bytes(model_shards) + file_bytes(side_shards)
        check_writable(out, need_bytes=need)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create {out.parent}: {e.strerror or e}; choose another --out") from None

        # Routers stay in bf16: named so that no loader quantizes them.
        ignore = ["lm_head", *routers(inputs.shapes, inputs.blocks), *exact_linears(inputs.shapes)]

        def config() -> dict:
            """config.json of the checkpoint: its provenance names the weights' fingerprint, which
            (when not cached) was hashed while the stream ran and is checked against the
            calibration and plan here, before anything is renamed into place."""
            qc = families.hub_quantization_config() if hub else args.format.quantization_config(ignore, __version__, kv_cache)
            qc["resserve"] = resserve_section(
                fmt, args.rounding.value, layout.groups, _provenance(inputs, calib, ratio if plan is None else None), kv_cache, args.experts_layout
            )
            return {**inputs.config, "quantization_config": qc}

        def write(tmp: Path) -> None:
            mw = ShardedWriter(tmp, MODEL_PREFIX, model_shards)
            sw = ShardedWriter(tmp, SIDECAR_PREFIX, side_shards)
            try:
                smoothed = SmoothedSource(inputs.source, inputs.smoothing, inputs.gptq)
                stream(layout, smoothed, inputs.stats, inputs.ratios, fmt, args.rounding, args.device, mw, sw, progress, kv, args.depth)
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
            _copy_files(inputs.model_dir, tmp)
            for name, obj in ({} if hub else args.format.extra_files(ignore, __version__, kv_cache)).items():
                (tmp / name).write_text(dump_json(obj))
            (tmp / "config.json").write_text(dump_json(config()))

        _write_atomic(out, write, overwrite, args, need)
    finally:
        inputs.fingerprint.stop()  # a hashing still running (the pack failed) ends here
    written = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return PackResult(out, len(model_shards), len(side_shards), written, time.perf_counter() - t0, len(layout.groups))


def _provenance(inputs: PackInputs, calib: Path, ratio: float | None) -> dict:
    """What the checkpoint was made from (``quantization_config.resserve.provenance``)."""
    provenance = {
        "producer": {"name": "resserve-export", "version": __version__},
        "model_fingerprint": inputs.fingerprint.value(),
        "fingerprint_method": modelio.FINGERPRINT_METHOD,
        "source_dtype": source_dtype(inputs.shapes, [m for g in inputs.groups for m in g.modules], inputs.model_dir),
        "calibration": {k: inputs.calibration.get(k) for k in ("model", "dataset", "num_samples", "num_tokens", "seq_len", "seed")},
        "ratio": ratio,
        "plan": inputs.plan,
    }
    if inputs.smoothing is not None:
        # Only for smoothed checkpoints, so that round-to-nearest packs keep their bytes.
        provenance["weight_algo"] = {
            "name": "awq",
            "smoothed_groups": len(inputs.smoothing.folds),
            "scales_sha256": file_digest(calib / inputs.calibration["weight_algo"].get("file", AWQ_FILE)),
        }
    if inputs.gptq is not None:
        algo = provenance.setdefault("weight_algo", {})
        algo["name"] = inputs.calibration["weight_algo"]["name"]
        algo["gptq_sha256"] = file_digest(inputs.gptq.path)
        # calibrations from before --gptq-order took the columns in block order
        algo["gptq_order"] = inputs.calibration["weight_algo"].get("gptq_order", "block")
    return provenance


def _write_atomic(out: Path, write, overwrite: bool, args: PackArgs, need: int) -> None:
    """``write(tmp)`` into a hidden sibling of `out`, renamed to `out` once complete; a full disk
    or a failed write is a one-line `UserError` with nothing left behind."""
    threads = torch.get_num_threads()
    try:
        if args.device.type == "cpu":
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


__all__ = ["pack", "PackResult", "THREADS_ENV"]
