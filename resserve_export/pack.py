"""`pack`: stream a bf16 HF checkpoint into an NVFP4 / MXFP4 checkpoint with masks and K-Ext
extensions (SPEC §3–§7).

The whole output layout (every tensor's name, dtype and shape, and the shard split) follows
from the source's safetensors headers, the decision groups and their ratios (`build_layout`),
so `size` computes exact byte counts with the same function, headers are written first and
tensors stream to disk one at a time. Source tensors are read by offset (no mmap); a fused
group (q/k/v, gate/up) is read member by member wherever its shards are, so the peak memory
is one group's weights plus the runtime.

Atomic: everything is built in a hidden sibling ``.CKPT.partial-<pid>`` directory, fsynced
and renamed at the end; a later run removes partial directories of dead processes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import __version__, modelio
from .checkpoint import (
    HF_QUANT_CONFIG,
    MODEL_INDEX,
    MODEL_PREFIX,
    SIDECAR_INDEX,
    SIDECAR_PREFIX,
    SafetensorsFiles,
    ShardedWriter,
    TensorSpec,
    dump_json,
    file_bytes,
    natural_key,
    nvfp4_hf_quant_config,
    parse_size,
    quant_tensor_names,
    quantization_config,
    resserve_section,
    split_shards,
    st_dtype,
    _fsync_write,
)
from .constants import BLOCK, FORMATS, RATIOS, SELECTION_GROUP
from .errors import UserError
from .groups import Group, expert_modules, group_linears, linears_from_shapes
from .kext import ext_width
from .mxfp4 import ScaleRounding
from .outputs import check_out_dir, check_writable, clean_stale
from .ui import Progress

# Files of a source model that are weights or that we write ourselves: never copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt", ".onnx")
_OWN_FILES = {"config.json", MODEL_INDEX, SIDECAR_INDEX, HF_QUANT_CONFIG, "pytorch_model.bin.index.json"}
_FLOAT_DTYPES = {"BF16", "F16", "F32"}
_GROUP_CACHE_BYTES = 1 << 30
THREADS_ENV = "RESSERVE_PACK_THREADS"  # intra-op threads for CPU quantization (default 1)


# --------------------------------------------------------------------------------------------
# Layout: what the checkpoint will contain, from shapes alone
# --------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """Every output tensor in write order, the work items producing them, and group records."""

    fmt: str
    items: list[tuple[str, object]]  # ("copy", name) | ("group", Group)
    model: list[TensorSpec]
    sidecar: list[TensorSpec]
    groups: list[dict]
    tensor_class: dict[str, str] = field(default_factory=dict)

    def shards(self, max_bytes: int) -> tuple[list[list[TensorSpec]], list[list[TensorSpec]]]:
        return split_shards(self.model, max_bytes), split_shards(self.sidecar, max_bytes)


def _member_specs(fmt: str, module: str, N: int, K: int, ratio: float) -> tuple[list[TensorSpec], list[TensorSpec]]:
    b = BLOCK[fmt]
    names = quant_tensor_names(fmt)
    if fmt == "nvfp4":
        plain = [
            TensorSpec(f"{module}.{names[0]}", "U8", (N, K // 2)),
            TensorSpec(f"{module}.{names[1]}", "F8_E4M3", (N, K // b)),
            TensorSpec(f"{module}.{names[2]}", "F32", ()),
            TensorSpec(f"{module}.{names[3]}", "F32", ()),
        ]
    else:
        plain = [TensorSpec(f"{module}.{names[0]}", "U8", (N, K // 2)), TensorSpec(f"{module}.{names[1]}", "U8", (N, K // b))]
    side: list[TensorSpec] = []
    if ratio > 0:
        side.append(TensorSpec(f"{module}.resserve_mask", "U8", (K // SELECTION_GROUP,)))
    K_E = ext_width(K, ratio, fmt)
    if K_E:
        side.append(TensorSpec(f"{module}.resserve_weight", "U8", (N, K_E // 2)))
        side.append(TensorSpec(f"{module}.resserve_weight_scale", "F8_E4M3" if fmt == "nvfp4" else "U8", (N, K_E // b)))
    return plain, side


def model_groups(shapes: dict[str, tuple[str, tuple[int, ...]]]) -> list[Group]:
    """Decision groups of a checkpoint from its headers; MoE experts are refused."""
    linears = linears_from_shapes(shapes)
    experts = expert_modules(sorted(linears, key=natural_key))
    if experts:
        more = f" and {len(experts) - 3} more" if len(experts) > 3 else ""
        raise UserError(f"MoE expert linears are not supported yet: {', '.join(experts[:3])}{more}")
    ordered = {m: linears[m] for m in sorted(linears, key=natural_key)}
    return group_linears(ordered)


def build_layout(
    shapes: dict[str, tuple[str, tuple[int, ...]]],
    groups: list[Group],
    ratios: dict[str, float],
    fmt: str,
    tied: bool,
) -> Layout:
    """The output layout for source tensors `shapes` (name -> (dtype, shape)).

    Order is canonical (natural sort of source names, a group's outputs at its first member), so
    the same inputs always give the same files. `ratios` maps ``group.name`` to ρ.
    """
    b = BLOCK[fmt]
    member_of = {m: g for g in groups for m in g.modules}
    items: list[tuple[str, object]] = []
    model: list[TensorSpec] = []
    sidecar: list[TensorSpec] = []
    cls: dict[str, str] = {}
    records: list[dict] = []
    done: set[str] = set()
    names = sorted(shapes, key=natural_key)
    has_embed = any(n.endswith("embed_tokens.weight") for n in names)
    for name in names:
        dtype, shape = shapes[name]
        if tied and name == "lm_head.weight" and has_embed:
            continue  # tied embeddings are stored once
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        g = member_of.get(mod) if mod else None
        if g is None:
            items.append(("copy", name))
            model.append(TensorSpec(name, dtype, tuple(shape)))
            cls[name] = "unquantized"
            continue
        if g.name in done:
            continue
        done.add(g.name)
        K = g.in_features
        bad = [m for m in g.modules if shapes[f"{m}.weight"][0] not in _FLOAT_DTYPES]
        if bad:
            raise UserError(f"{bad[0]}.weight has dtype {shapes[bad[0] + '.weight'][0]}: pack needs bf16/fp16/fp32 weights")
        if K % b:
            raise UserError(
                f"{', '.join(g.modules)}: in_features {K} is not a multiple of the {fmt} block size {b}; "
                "this model cannot be packed in that format"
            )
        ratio = ratios[g.name]
        K_E = ext_width(K, ratio, fmt)
        for m, N in zip(g.modules, g.out_features):
            plain, side = _member_specs(fmt, m, N, K, ratio)
            model += plain
            sidecar += side
            for s in plain:
                cls[s.name] = "linear"
            for s in side:
                cls[s.name] = "mask" if s.name.endswith("resserve_mask") else "extension"
        items.append(("group", g))
        mode = "plain" if ratio == 0 else ("full" if ratio == 1 else "k_ext")
        records.append({"members": list(g.modules), "ratio": ratio, "mode": mode, "K": K, "K_E": K_E})
    return Layout(fmt, items, model, sidecar, records, cls)


# --------------------------------------------------------------------------------------------
# Inputs: calibration and ratios
# --------------------------------------------------------------------------------------------


def load_calibration(
    calib: Path, model_fingerprint: str, groups: list[Group], allow_other_weights: bool = False
) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(calibration.json, {module: (mean_abs, amax)}) checked against the model.

    The calibration must have been made from these exact weights (content fingerprint), unless
    `allow_other_weights`; every amax must be finite and positive (it becomes a scale).
    """
    calib = Path(calib)
    meta_path, sal_path = calib / "calibration.json", calib / "salience.safetensors"
    if not meta_path.exists() or not sal_path.exists():
        raise UserError(f"{calib} is not a calibration directory (needs calibration.json and salience.safetensors): run `resserve-export calibrate` first")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError:
        raise UserError(f"{meta_path} is not valid JSON: re-run calibrate") from None
    if not allow_other_weights:
        modelio.check_fingerprint(meta, model_fingerprint, f"calibration in {calib}")
    sal = SafetensorsFiles([sal_path])
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
    if fmt == "mxfp4" and pr != rounding:
        raise UserError(
            f"plan {path} was made from MXFP4 scores with scale rounding {pr} but --mx-scale is {rounding}: "
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
        if not p.is_file() or p.name.startswith(".") or p.name in _OWN_FILES or p.name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copyfile(p, dst / p.name)
        with open(dst / p.name, "rb") as f:
            os.fsync(f.fileno())
        copied.append(p.name)
    return copied


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pick_device(device: str) -> torch.device:
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"unknown device {device!r}: choose auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked but no CUDA GPU is visible: use --device cpu or auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


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
) -> PackResult:
    """Write the checkpoint directory of SPEC §7 to `out` (see the module docstring)."""
    t0 = time.perf_counter()
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
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
    groups = model_groups(shapes)
    fingerprint = modelio.fingerprint(model_dir)
    calib_meta, stats = load_calibration(Path(calib), fingerprint, groups, allow_other_weights)
    ratios, plan_prov = load_ratios(
        groups, ratio, Path(plan) if plan is not None else None, fingerprint, fmt, rounding.value, allow_other_weights
    )
    # Drop lm_head only when the config says explicitly that it is tied: an extra copy costs
    # bytes, a missing one breaks the model.
    tied = cfg.get("tie_word_embeddings") is True
    layout = build_layout(shapes, groups, ratios, fmt, tied)
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
    qc = quantization_config(fmt, ignore, resserve_section(fmt, rounding.value, layout.groups, provenance), __version__)
    new_cfg = dict(cfg)
    new_cfg["quantization_config"] = qc

    clean_stale(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:
        raise UserError(f"cannot write in {out.parent}: {e.strerror or e}; choose another --out") from None
    mw = ShardedWriter(tmp, MODEL_PREFIX, model_shards)
    sw = ShardedWriter(tmp, SIDECAR_PREFIX, side_shards)
    threads = torch.get_num_threads()
    try:
        if dev.type == "cpu":
            # One intra-op thread: the compiled quantizer runs one short OpenMP region per chunk,
            # and with several threads each region waits for the slowest one, which on a shared
            # CPU can be descheduled (measured on 2 busy cores: 1 thread 0.14 s, 2 threads 0.5-5 s
            # for a 9728x2560 bf16 weight). Reading the next group overlaps on another thread.
            torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
        _stream(layout, source, stats, ratios, fmt, rounding, dev, mw, sw, progress)
        mw.close()
        sw.close()
        _fsync_write(tmp / MODEL_INDEX, dump_json(mw.index()))
        if side_shards:
            _fsync_write(tmp / SIDECAR_INDEX, dump_json(sw.index()))
        _copy_files(model_dir, tmp)
        if fmt == "nvfp4":
            _fsync_write(tmp / HF_QUANT_CONFIG, dump_json(nvfp4_hf_quant_config(ignore, __version__)))
        _fsync_write(tmp / "config.json", dump_json(new_cfg))
        _fsync_dir(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        _fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        mw.abort()
        sw.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise UserError(
                f"no space left on the device while writing {out.name} (it needs about {need / 1e9:.2f} GB): "
                "free space or choose another --out; nothing was written"
            ) from None
        raise UserError(f"writing {out} failed: {e.strerror or e}; nothing was written") from None
    except BaseException:
        mw.abort()
        sw.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    written = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return PackResult(out, len(model_shards), len(side_shards), written, time.perf_counter() - t0, len(groups))


def _stream(layout, source, stats, ratios, fmt, rounding, dev, mw, sw, progress) -> None:
    """Produce every output tensor in layout order. The next group's weights are read by a
    background thread while the current group is quantized (reads and kernels release the GIL),
    so at most two groups' weights are in memory."""
    from concurrent.futures import ThreadPoolExecutor

    from . import formats, nvfp4
    from .kext import extend_weight
    from .selection import select_mask

    def group_bytes(g: Group) -> int:
        return sum(source.entries[f"{m}.weight"].nbytes for m in g.modules)

    def load(g: Group) -> dict[str, torch.Tensor] | None:
        if group_bytes(g) > _GROUP_CACHE_BYTES:
            return None  # too large to hold: _pack_group reads members one at a time
        return {m: source.get(f"{m}.weight") for m in g.modules}

    total_bytes = sum(source.entries[n].nbytes if kind == "copy" else group_bytes(n) for kind, n in layout.items)
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
            else:
                g: Group = item
                bar.describe(f"{i + 1}/{n} {g.modules[0][-40:]}")
                weights = pending.pop(i).result()
                if i in next_group:
                    j = next_group[i]
                    pending[j] = pool.submit(load, layout.items[j][1])
                _pack_group(g, weights, source, stats, ratios[g.name], fmt, rounding, dev, mw, sw, formats, nvfp4, extend_weight, select_mask)
                del weights
                bar.advance(group_bytes(g))


def _pack_group(g, weights, source, stats, ratio, fmt, rounding, dev, mw, sw, formats, nvfp4, extend_weight, select_mask) -> None:
    names = quant_tensor_names(fmt)
    amax_x = torch.stack([stats[m][1] for m in g.modules]).max()
    mask = select_mask(stats[g.modules[0]][0], ratio) if ratio > 0 else None

    def weight(m: str) -> torch.Tensor:
        return weights[m] if weights is not None else source.get(f"{m}.weight")

    alpha = None
    if fmt == "nvfp4":
        # One weight_scale_2 for the fused group: the max over members of amax(W) / 2688.
        alpha = nvfp4.group_global_scale(weight(m) for m in g.modules).to(dev)
        if not bool(torch.isfinite(alpha)):
            raise UserError(f"{' / '.join(g.modules)}: the weights hold NaN or Inf values (weight_scale_2 {float(alpha)}): fix the source checkpoint")
    else:
        for m in g.modules:
            lo, hi = torch.aminmax(weight(m))
            if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
                raise UserError(f"{m}: the weight holds NaN or Inf values: fix the source checkpoint")
    input_scale = nvfp4.global_scale(amax_x).reshape(())
    for m in g.modules:
        w = weight(m).to(dev, non_blocking=True)
        q = formats.quantize(w, fmt, alpha=alpha, rounding=rounding)
        mw.write(f"{m}.{names[0]}", q.codes)
        mw.write(f"{m}.{names[1]}", q.scales)
        if fmt == "nvfp4":
            mw.write(f"{m}.{names[2]}", q.global_scale.reshape(()).float())
            mw.write(f"{m}.{names[3]}", input_scale.float())
        if mask is not None:
            sw.write(f"{m}.resserve_mask", mask)
            ext = extend_weight(w, mask.to(dev), ratio, fmt, rounding, alpha=alpha)
            if ext is not None:
                sw.write(f"{m}.resserve_weight", ext.codes)
                sw.write(f"{m}.resserve_weight_scale", ext.scales)
        del w, q


__all__ = ["pack", "build_layout", "model_groups", "Layout", "PackResult", "load_ratios", "load_calibration"]
