"""`pack`: stream a bf16 HF checkpoint into an NVFP4 / MXFP4 checkpoint with masks and K-Ext
extensions (SPEC §3–§7).

The whole output layout (every tensor's name, dtype and shape, and the shard split) follows
from the source's safetensors headers, the decision groups and their ratios (`build_layout`),
so `size` computes exact byte counts with the same function, headers are written first and
tensors stream to disk one at a time. Source tensors are read by offset (no mmap); a fused
group (q/k/v, gate/up) is read member by member wherever its shards are, so the peak memory
is one group's weights plus the runtime.

Atomic: everything is built in a hidden sibling ``.CKPT.tmp-<pid>-…`` directory, fsynced
and renamed at the end; a later run removes partial directories of dead processes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__, modelio, registry
from .checkpoint import (
    MODEL_INDEX,
    MODEL_PREFIX,
    SIDECAR_INDEX,
    SIDECAR_PREFIX,
    SafetensorsFiles,
    ShardedWriter,
    dump_json,
    file_bytes,
    parse_size,
    resserve_section,
)
from .constants import RATIOS
from .errors import UserError
from .groups import Group
from .layout import OWN_FILES, WEIGHT_SUFFIXES, build_layout, model_groups, recorded_groups, refuse_experts
from .mxfp4 import ScaleRounding
from .outputs import check_out_dir, check_writable, write_dir_atomic
from .ui import Progress

_GROUP_CACHE_BYTES = 1 << 30
THREADS_ENV = "RESSERVE_PACK_THREADS"  # intra-op threads for CPU quantization (default 1)


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
    from .plan import load_plan, module_ratios

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


def check_plan_format(plan: dict, path: Path, fmt: str, rounding: str | None) -> None:
    """Refuse a plan whose scores were computed for another format or MXFP4 scale rounding."""
    pf, pr = plan.get("format"), plan.get("mx_scale_rounding")
    if pf is None:
        raise UserError(f"plan {path} does not record the format its scores were computed for: re-run `resserve-export plan`")
    if pf != fmt:
        raise UserError(
            f"plan {path} was made from {pf} scores but --format is {fmt}: pack with --format {pf}, "
            f"or calibrate with --format {fmt} and plan again"
        )
    if registry.get(fmt).has_rounding and pr != rounding:
        raise UserError(
            f"plan {path} was made from {fmt.upper()} scores with scale rounding {pr} but --mx-scale is {rounding}: "
            f"pack with --mx-scale {pr}, or calibrate with --mx-scale {rounding} and plan again"
        )


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


def source_dtype(shapes: dict[str, tuple[str, tuple[int, ...]]], modules: list[str], model_dir: Path) -> str:
    """The torch dtype name (``bfloat16``, ``float16``, ``float32``) of the quantized linears'
    weights in the source headers `shapes` (name -> (safetensors dtype, shape)).

    `pack` records it so that `verify` loads the model in the dtype the weights were quantized
    from: in any other dtype the re-quantization differs and the NMSE reference is not the
    source's. One dtype is required, since the model is loaded in one.
    """
    from .checkpoint import DTYPES

    found = sorted({shapes[f"{m}.weight"][0] for m in modules})
    if len(found) != 1:
        raise UserError(f"the quantized linears of {model_dir} have mixed weight dtypes ({', '.join(found)}): convert the model to one dtype first")
    return str(DTYPES[found[0]][0]).removeprefix("torch.")


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
    from . import kvcache

    t0 = time.perf_counter()
    f = check_format_arg(fmt)
    kvcache.check_for_format(kv_cache, f)  # before any work; build_layout relies on it too
    try:
        rounding = ScaleRounding(mx_scale)
    except ValueError:
        raise UserError(f"unknown --mx-scale {mx_scale!r}: choose one of {', '.join(r.value for r in ScaleRounding)}") from None
    if ratio is not None:
        check_ratio_arg(ratio)
    max_bytes = parse_size(max_shard_size)
    dev = pick_device(device)
    out = Path(out).expanduser().absolute()
    check_out_dir(out, overwrite)
    model_dir = modelio.resolve_model(model)
    modelio.check_architecture(model_dir, "pack")
    source = SafetensorsFiles(modelio.weight_files(model_dir))
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise UserError(f"{model_dir} is already quantized ({cfg['quantization_config'].get('quant_method')}): pack needs a bf16/fp16 model")
    shapes = source.shapes()
    refuse_experts(shapes)
    fingerprint = modelio.fingerprint(model_dir)
    # The quantized linears and their fused groups are the ones calibrate found on the loaded
    # model (one rule), not re-derived from the headers.
    recorded = read_calibration(Path(calib), fingerprint, allow_other_weights).get("groups")
    groups = recorded_groups(recorded, shapes) if recorded else model_groups(shapes)
    calib_meta, stats = load_calibration(Path(calib), fingerprint, groups, allow_other_weights)
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
    ignore = ["lm_head"]
    qc = f.quantization_config(ignore, __version__, kv_cache)
    qc["resserve"] = resserve_section(fmt, rounding.value, layout.groups, provenance, kv_cache)
    new_cfg = dict(cfg)
    new_cfg["quantization_config"] = qc

    threads = torch.get_num_threads()

    def write(tmp: Path) -> None:
        mw = ShardedWriter(tmp, MODEL_PREFIX, model_shards)
        sw = ShardedWriter(tmp, SIDECAR_PREFIX, side_shards)
        try:
            _stream(layout, source, stats, ratios, fmt, rounding, dev, mw, sw, progress, kv_tensors)
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
    from . import kvcache

    if kv_cache == "none":
        return {}
    attention = kvcache.attention_modules(shapes)
    amax = kvcache.load(calib, attention)
    shape = kvcache.scale_shape(f.kv_style)
    out = {}
    for a in attention:
        for name, x in zip(kvcache.scale_names(a, f.kv_style), amax[a]):
            out[name] = kvcache.scale_from_amax(x).reshape(shape).contiguous()
    return out


def _stream(layout, source, stats, ratios, fmt, rounding, dev, mw, sw, progress, kv_tensors=None) -> None:
    """Produce every output tensor in layout order. The next group's weights are read by a
    background thread while the current group is quantized (reads and kernels release the GIL),
    so at most two groups' weights are in memory."""
    from concurrent.futures import ThreadPoolExecutor

    from . import formats
    from .kext import extend_weight
    from .selection import select_mask

    def group_bytes(g: Group) -> int:
        return sum(source.entries[f"{m}.weight"].nbytes for m in g.modules)

    def load(g: Group) -> dict[str, torch.Tensor] | None:
        if group_bytes(g) > _GROUP_CACHE_BYTES:
            return None  # too large to hold: _pack_group reads members one at a time
        return {m: source.get(f"{m}.weight") for m in g.modules}

    sizes = {"copy": lambda n: source.entries[n].nbytes, "group": group_bytes, "kv": lambda n: 0}
    total_bytes = sum(sizes[kind](n) for kind, n in layout.items)
    group_at = [i for i, (kind, _) in enumerate(layout.items) if kind == "group"]
    next_group = {a: b for a, b in zip(group_at, group_at[1:])}
    with Progress("pack", total_bytes, unit="bytes", enabled=progress) as bar, ThreadPoolExecutor(1, thread_name_prefix="pack-read") as pool:
        n = len(layout.items)
        pending = {group_at[0]: pool.submit(load, layout.items[group_at[0]][1])} if group_at else {}
        for i, (kind, item) in enumerate(layout.items):
            if kind == "copy":
                bar.describe(f"{i + 1}/{n} {item[-40:]}")
                mw.write_raw(item, source.iter_bytes(item))
                bar.advance(source.entries[item].nbytes)
            elif kind == "kv":
                mw.write(item, kv_tensors[item])
            else:
                g: Group = item
                bar.describe(f"{i + 1}/{n} {g.modules[0][-40:]}")
                weights = pending.pop(i).result()
                if i in next_group:
                    j = next_group[i]
                    pending[j] = pool.submit(load, layout.items[j][1])
                _pack_group(g, weights, source, stats, ratios[g.name], fmt, rounding, dev, mw, sw, formats, extend_weight, select_mask)
                del weights
                bar.advance(group_bytes(g))


def _pack_group(g, weights, source, stats, ratio, fmt, rounding, dev, mw, sw, formats, extend_weight, select_mask) -> None:
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
            sw.write(f"{m}.resserve_mask", mask)
            ext = extend_weight(w, mask.to(dev), ratio, f, rounding, alpha=alpha)
            if ext is not None:
                sw.write(f"{m}.resserve_weight", ext.codes)
                sw.write(f"{m}.resserve_weight_scale", ext.scales)
        del w, q


__all__ = ["pack", "build_layout", "model_groups", "Layout", "PackResult", "load_ratios", "load_calibration"]
