"""Calibration: activation salience (mean |x| per input channel) and amax of every quantized linear.

Forward pre-hooks sit on the first member of each decision group (SPEC §5: q/k/v and gate/up read
one input, so one record serves the group). Per batch a hook takes |x| of the valid (non-padding)
tokens once, reduces it over tokens in float32 (float64 for a float64 model) and adds the result to
a float64 accumulator (SPEC §9: never accumulated in the model dtype); amax is kept as a running
maximum. Non-finite activations are caught once per batch and reported with the first layer, in
forward order, that saw them.

Output (the calibration dir, written atomically by :func:`write_dir_atomic`):
``salience.safetensors`` (``<module>.mean_abs`` float32 ``[in_features]``, ``<module>.amax`` float32
0-d, for every quantized linear), ``calibration.json`` (provenance; the only run-dependent field is
``wall_time_s``), and with ``--scores`` a ``scores.json`` from :mod:`resserve_export.scores`.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from resserve_export.formats.constants import MXFP4_BLOCK, RATIOS
from resserve_export.formats.registry import FORMATS
from resserve_export.core.errors import UserError
from resserve_export.modeling.groups import Group, expert_modules, group_linears, is_quantized
from resserve_export.core.outputs import check_out_dir, clean_stale, temp_sibling, write_dir_atomic
from resserve_export.core.ui import Progress

# The presets: the repository's calib_configs/, installed as the package data of
# resserve_export.calib_configs (pyproject's package-dir), so bare names work from a wheel too.
CONFIG_DIR = importlib.resources.files("resserve_export.calib_configs")
SCORE_METHODS = ("none", "grad", "kl")
DTYPES = ("bfloat16", "float16", "float32", "float64")
# Every quantized input dimension must hold whole MXFP4 blocks (32), which also covers NVFP4 (16).
IN_FEATURES_MULTIPLE = MXFP4_BLOCK
# CPU hook reduction chunk: 2**19 floats (2 MiB in float32) stay in a core's L2/L3.
CPU_CHUNK_ELEMENTS = 1 << 19


def _abs_sum_max(x):
    a = x.float().abs()
    return a.sum(0), a.amax()


@functools.lru_cache(maxsize=1)
def _compiled_cpu_reduce():
    """Σ|x| (FP32, per column) and max|x| fused into one pass over the activation by inductor.

    About 3x cheaper than the chunked eager reduction on CPU; None (eager fallback) when
    compilation is unavailable or disabled with RESSERVE_BACKEND=reference.
    """
    import torch

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


@dataclass
class CalibConfig:
    """Calibration settings. Defaults are the published protocol (SPEC §9), as in paper.yaml."""

    dataset: str = "shakespeare"
    num_samples: int = 1024
    seq_len: int = 2048
    batch_size: int = 8
    seed: int = 42
    device: str = "auto"
    dtype: str = "bfloat16"
    scores: str = "grad"
    score_samples: int = 32
    score_precision: str = "auto"
    format: str = "nvfp4"
    mx_scale: str = "ceil"
    weight_algo: str = "rtn"
    awq_tokens: int = 2048
    pipeline: str = "auto"
    moe_calib: str = "all"

    def validate(self) -> CalibConfig:
        for name in ("num_samples", "seq_len", "batch_size", "score_samples", "awq_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UserError(f"--seed must be a non-negative integer, got {self.seed!r}")
        if self.scores not in SCORE_METHODS:
            raise UserError(f"--scores must be one of {', '.join(SCORE_METHODS)}, got {self.scores!r}")
        if self.format not in FORMATS:
            raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        from resserve_export.formats.mxfp4 import ScaleRounding

        roundings = [r.value for r in ScaleRounding]
        if self.mx_scale not in roundings:
            raise UserError(f"--mx-scale must be one of {', '.join(roundings)}, got {self.mx_scale!r}")
        from resserve_export.algorithms.scores import PRECISIONS as SCORE_PRECISIONS

        if self.score_precision not in SCORE_PRECISIONS:
            raise UserError(f"--score-precision must be one of {', '.join(SCORE_PRECISIONS)}, got {self.score_precision!r}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        from resserve_export.algorithms.awq.smoothing import check_weight_algo
        from resserve_export.stages.calibrate.sequential import PIPELINES

        check_weight_algo(self.weight_algo)
        if self.pipeline not in PIPELINES:
            raise UserError(f"--pipeline must be one of {', '.join(PIPELINES)}, got {self.pipeline!r}")
        from resserve_export.modeling.experts import MOE_CALIB

        if self.moe_calib not in MOE_CALIB:
            raise UserError(f"--moe-calib must be one of {', '.join(MOE_CALIB)}, got {self.moe_calib!r}")
        return self


@dataclass(frozen=True)
class CalibrationResult:
    """A written calibration directory; `record` is its calibration.json."""

    path: Path
    model: str
    fingerprint: str
    groups: list[tuple[str, ...]]
    num_samples: int
    num_tokens: int
    scores: str  # grad | kl | none (scores.json exists unless none)
    wall_time_s: float
    record: dict


def preset_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in CONFIG_DIR.iterdir() if p.name.endswith(".yaml") and p.is_file())


def load_preset(name_or_path: str) -> dict:
    """Settings from a preset: a YAML path, or a bare name of a packaged preset (``calib_configs/NAME.yaml``)."""
    import yaml

    path = Path(name_or_path).expanduser()
    if not path.is_file():
        for cand in (CONFIG_DIR / f"{name_or_path}.yaml", Path.cwd() / "calib_configs" / f"{name_or_path}.yaml"):
            if cand.is_file():
                path = cand
                break
        else:
            raise UserError(f"unknown calibration config {name_or_path!r}, available names: [{', '.join(preset_names())}] or a YAML path")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a mapping of settings, e.g. 'num_samples: 32'")
    known = {f.name for f in fields(CalibConfig)}
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"{path}: unknown setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    return data


def make_config(preset: str | None = None, **overrides) -> CalibConfig:
    """Preset values, then every override that is not None (flags override the preset)."""
    values = load_preset(preset) if preset else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return CalibConfig(**values).validate()


def check_in_features(linears: dict[str, tuple[int, int]]) -> None:
    """Every quantized linear needs in_features divisible by 32 (whole FP4 blocks and selection groups)."""
    for name in sorted(linears, key=_natural_key):
        k = linears[name][1]
        if is_quantized(name) and k % IN_FEATURES_MULTIPLE:
            raise UserError(
                f"linear {name} has in_features {k}, not a multiple of {IN_FEATURES_MULTIPLE}: "
                "FP4 blocks cannot tile it; this model is not supported"
            )


def _same_rows(shape: tuple, batch: tuple) -> bool:
    """Whether leading dims `shape` are the batch's [B, T] with extra size-1 dims (DeepSeek's MLA
    feeds kv_b_proj [B, 1, T, r]) or flattened (Qwen2-MoE's shared expert reads [B·T, H]): its
    rows are then the batch's tokens in order."""
    return tuple(d for d in shape if d != 1) == tuple(d for d in batch if d != 1) or tuple(shape) == (math.prod(batch),)


def _natural_key(name: str) -> list:
    """Sort module paths with layer numbers as numbers (layers.2 before layers.10)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in name.split(".")]


def finite_each(tensors: list) -> list[bool]:
    """Whether each tensor holds only finite values, with one device-to-host copy per device
    (not one per tensor: a sync per layer would stall a GPU forward's launch queue)."""
    import torch

    by_device: dict = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out = [True] * len(tensors)
    for idx in by_device.values():
        flat = torch.isfinite(torch.cat([tensors[i].reshape(-1) for i in idx])).tolist()
        pos = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = all(flat[pos : pos + n])
            pos += n
    return out


class StatsCollector:
    """Forward pre-hooks accumulating Σ|x| (float64), valid-token count and amax per decision group.

    Use :meth:`set_mask` with each batch's attention mask before the forward pass and
    :meth:`end_batch` after it. Padding tokens (mask 0) never enter the statistics.
    """

    # GPU token reduction: "norm" (fused |x| in the reduction kernels) or "abs" (|x| materialised).
    gpu_reduction = "norm"

    def __init__(self, model, groups: list[Group], keep_batches: bool = False):
        import torch

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
        self._handles = []
        self._cpu_buf: dict = {}
        self._cpu_ones: dict = {}
        self.paused = False  # hooks do nothing while set (the sequential pipeline's score batches)
        for gi, g in enumerate(groups):
            head = g.modules[0]
            if head not in modules:
                raise UserError(f"linear {head} is not in the model: the weights and the architecture do not match")
            self._handles.append(modules[head].register_forward_pre_hook(self._make_hook(gi)))

    def __enter__(self) -> StatsCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

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

        Each chunk is copied into a reused float buffer, made absolute in place, summed with a
        GEMV and max-reduced: the activation is read from memory once, and no large temporary
        is allocated (page faults of fresh buffers cost as much as the arithmetic).
        """
        torch = self._torch
        t, k = xf.shape
        rows = max(1, min(t, CPU_CHUNK_ELEMENTS // k))
        buf = self._cpu_buf.get(acc)
        if buf is None or buf.numel() < rows * k:
            buf = self._cpu_buf[acc] = torch.empty(rows * k, dtype=acc)
        ones = self._cpu_ones.get(acc)
        if ones is None or ones.numel() < rows:
            ones = self._cpu_ones[acc] = torch.ones(rows, dtype=acc)
        s = torch.zeros(k, dtype=acc)
        maxima = []
        for i in range(0, t, rows):
            n = min(rows, t - i)
            a = buf[: n * k].view(n, k).copy_(xf[i : i + n]).abs_()
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
                if xf.device.type == "cpu" and acc == torch.float32 and _compiled_cpu_reduce() is not None:
                    s, m = _compiled_cpu_reduce()(xf)
                elif xf.device.type == "cpu":
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


def forward_kwargs(model) -> dict:
    """Extra forward arguments: no KV cache, and logits of the last position only (lm_head is not quantized)."""
    import inspect

    kw = {"use_cache": False}
    try:
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            kw["logits_to_keep"] = 1
    except (TypeError, ValueError):
        pass
    return kw


def input_device(model):
    """Where input ids go: the embedding's device (accelerate moves them on when offloading)."""
    import torch

    emb = model.get_input_embeddings()
    dev = emb.weight.device if emb is not None else next(model.parameters()).device
    return torch.device("cpu") if dev.type == "meta" else dev


def collect(
    model, batches: list[dict], groups: list[Group], progress: Callable[[int, int], None] | None = None, kv=None, parts: bool = False,
    experts=None,
) -> tuple[dict, int]:
    """Run ``batches`` through ``model`` with the statistics hooks. Returns (stats, num_tokens).

    `kv`: a `kvcache.KVCollector` that also sees every batch (through the KV cache the forward
    pass then fills). `parts`: return `StatsCollector.parts()` (a data-parallel rank's share)
    instead of the statistics. `experts`: an installed `experts.ExpertCollector` that sees every
    batch too."""
    import torch

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


def save_stats(stats: dict[str, dict], path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for m in sorted(stats):
        tensors[f"{m}.mean_abs"] = stats[m]["mean_abs"].contiguous()
        tensors[f"{m}.amax"] = stats[m]["amax"].contiguous()
    # One metadata key only: safetensors writes several in random order (files must be byte-identical).
    save_file(tensors, str(path), metadata={"resserve_salience": "1"})


def load_stats(calib_dir: Path) -> dict[str, dict]:
    """Read ``salience.safetensors`` back as ``{module: {"mean_abs": ..., "amax": ...}}``."""
    from safetensors.torch import load_file

    path = Path(calib_dir) / "salience.safetensors"
    if not path.is_file():
        raise UserError(f"{calib_dir} is not a calibration directory (no salience.safetensors): run `resserve-export calibrate` first")
    out: dict[str, dict] = {}
    for k, v in load_file(str(path)).items():
        mod, _, field = k.rpartition(".")
        out.setdefault(mod, {})[field] = v
    return out


def versions() -> dict[str, str]:
    from importlib import metadata

    from resserve_export import __version__

    out = {"resserve-export": __version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "datasets", "accelerate", "safetensors"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def calibrate(
    model: str,
    out: Path,
    config: CalibConfig,
    overwrite: bool = False,
    show_progress: bool = True,
    on_batch: Callable[[int], None] | None = None,
    resume: bool = False,
) -> CalibrationResult:
    """The whole command: resolve the model, sample the data, collect statistics, write ``out``
    atomically. `resume`: continue an interrupted layer-by-layer run of the same ``out``."""
    from resserve_export.modeling import data
    from resserve_export.observers import kvcache
    from resserve_export.modeling import modelio

    t0 = time.perf_counter()
    config.validate()
    out = Path(out)
    check_out_dir(out, overwrite)
    clean_stale(out)
    modelio.parse_device(config.device)
    model_dir = modelio.resolve_model(model)
    modelio.check_architecture(model_dir, "calibrate")
    shapes = modelio.tensor_shapes(model_dir)
    from resserve_export.core.distributed import world_size
    from resserve_export.modeling.experts import expert_blocks

    blocks = expert_blocks(shapes, "calibrated")
    if blocks:
        _check_moe_settings(config, world_size())
    check_in_features(_quantized_linears(shapes))
    fingerprint = modelio.fingerprint(model_dir)
    docs = data.load_documents(config.dataset)
    tokenizer = modelio.load_tokenizer(model_dir)
    samples = data.make_samples(tokenizer, docs, config.num_samples, config.seq_len, config.seed)
    batches = data.batches(samples, config.batch_size, data.pad_id(tokenizer))

    ranks = None
    if world_size() > 1:
        if resume:
            raise UserError("--resume does not run under torchrun: run it in one process")
        if config.scores == "kl":
            raise UserError("--scores kl does not run under torchrun: use --scores grad, or one process")
        from dataclasses import replace

        from resserve_export.core.distributed import Ranks

        ranks = Ranks.start(config.device)
        config = replace(config, device=ranks.device(config.device))
    pipeline = "whole" if blocks else choose_pipeline(config, shapes)
    if ranks is not None:
        pipeline = ranks.broadcast(pipeline)  # auto: rank 0's choice (free memory differs by device)
    if resume and pipeline != "sequential":
        raise UserError("--resume continues a layer-by-layer run: pass --pipeline sequential with the interrupted run's settings")
    samples_sha256, versions_ = data.samples_digest(samples), versions()
    # The sequential pipeline does not smooth (AWQ needs the whole model).
    smoothing, weight_algo, moe = None, {"name": "rtn"}, None
    if ranks is not None and pipeline == "sequential":
        got = _collect_ranks_sequential(ranks, model_dir, out, config, batches, show_progress and ranks.rank == 0)
        stats, num_tokens, kv_stats, kv_problem, groups, scores = got
    elif ranks is not None:
        got = _collect_ranks(ranks, model_dir, config, batches, shapes, show_progress and ranks.rank == 0)
        stats, num_tokens, kv_stats, kv_problem, groups, smoothing, weight_algo, scores = got
    elif pipeline == "sequential":
        key = {"fingerprint": fingerprint, "samples_sha256": samples_sha256, "versions": versions_}
        key.update({k: v for k, v in asdict(config).items() if k != "pipeline"})
        stats, num_tokens, kv_stats, kv_problem, groups, scores = _collect_sequential(
            model_dir, out, config, batches, show_progress, on_batch, key, resume
        )
    else:
        stats, num_tokens, kv_stats, kv_problem, groups, smoothing, weight_algo, scores, moe = _collect_whole(
            model_dir, out, config, batches, shapes, show_progress, on_batch, blocks
        )
    if scores is not None:
        scores["fingerprint"] = fingerprint

    record = {
        "model": modelio.model_label(model),
        "model_dir": str(model_dir),
        "fingerprint": fingerprint,
        "fingerprint_method": modelio.FINGERPRINT_METHOD,
        "dataset": config.dataset,
        "num_samples": len(samples),
        "num_tokens": num_tokens,
        "seq_len": config.seq_len,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "samples_sha256": samples_sha256,
        "dtype": config.dtype,
        "device": config.device,
        "scores": config.scores,
        "versions": versions_,
        "groups": [list(g.modules) for g in groups],
        "pipeline": pipeline,
        "weight_algo": weight_algo,
        "kv_cache": (
            {"file": kvcache.FILE, "point": kvcache.POINT, "layers": len(kv_stats)}
            if kv_stats is not None
            else {"file": None, "why_not": kv_problem}
        ),
        "config": asdict(config),
    }
    if moe is not None:
        record["moe"] = moe

    def write(tmp: Path) -> None:
        save_stats(stats, tmp / "salience.safetensors")
        if smoothing is not None:
            smoothing.save(tmp / weight_algo["file"])
        if kv_stats is not None:
            kvcache.save(kv_stats, tmp / kvcache.FILE)
        if scores is not None:
            (tmp / "scores.json").write_text(json.dumps(scores, indent=2) + "\n")
        record["wall_time_s"] = round(time.perf_counter() - t0, 3)
        (tmp / "calibration.json").write_text(json.dumps(record, indent=2) + "\n")

    if ranks is None:
        path = write_dir_atomic(out, write, overwrite)
    else:
        record["data_parallel"] = {"ranks": ranks.size, "backend": ranks.backend}
        err = None
        if ranks.rank == 0:
            try:
                path = write_dir_atomic(out, write, overwrite)
            except BaseException as e:  # reported by rank 0; the others stop with one line
                err = e
        ranks.agree(err)
        path = out
        record = ranks.broadcast(record)
        ranks.close()
    return CalibrationResult(
        path, record["model"], fingerprint, [tuple(g) for g in record["groups"]], record["num_samples"], num_tokens,
        config.scores, record["wall_time_s"], record,
    )


def choose_pipeline(config: CalibConfig, shapes) -> str:
    """``whole`` or ``sequential`` for ``--pipeline`` (``auto``: sequential when the weights do not
    fit the devices the whole model would use, and only for what sequential supports)."""
    if config.pipeline == "sequential":
        if config.scores == "kl":
            raise UserError("--pipeline sequential computes --scores grad or none, not kl: use --scores grad, or --pipeline whole")
        if config.weight_algo != "rtn":
            raise UserError("--weight-algo awq needs --pipeline whole for now")
        return "sequential"
    if config.pipeline == "whole" or config.scores == "kl" or config.weight_algo != "rtn":
        return "whole"
    import torch

    from resserve_export.modeling.modelio import parse_device

    # The loaded model's bytes: every tensor in the load dtype.
    bytes_ = sum(math.prod(shape) for _, shape in shapes.values()) * getattr(torch, config.dtype).itemsize
    d = parse_device(config.device)
    if d == "cpu" or not torch.cuda.is_available():
        from resserve_export.stages.calibrate.sequential import available_memory

        room = available_memory()
    elif d == "auto":
        room = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    else:
        room = torch.cuda.mem_get_info(torch.device(d))[0]
    return "whole" if bytes_ < 0.8 * room else "sequential"


def _check_moe_settings(config: CalibConfig, ranks: int) -> None:
    """What a mixture-of-experts calibration does not do yet, refused before any work."""
    if config.pipeline == "sequential":
        raise UserError("--pipeline sequential does not run mixture-of-experts models yet: use --pipeline whole; nothing was calibrated")
    if ranks > 1:
        raise UserError("mixture-of-experts models calibrate in one process for now: run without torchrun; nothing was calibrated")


def model_groups_of(net, model_dir, blocks=()) -> list[Group]:
    """The decision groups of a loaded (or weightless) model's ``nn.Linear`` modules, and of the
    experts of `blocks` (`experts.ExpertBlock`) under their checkpoint names, each block's at the
    place of its fused module."""
    fused = {}
    if blocks:
        from resserve_export.modeling.experts import fused_modules

        fused = {id(mod): b for b, mod in zip(blocks, fused_modules(net, list(blocks)).values())}
    linears = {}
    for n, m in net.named_modules():
        if _is_linear(m):
            linears[n] = (m.out_features, m.in_features)
        elif id(m) in fused:
            linears.update(fused[id(m)].linears())
    check_in_features(linears)
    experts = expert_modules([n for n in linears if is_quantized(n)])
    if experts and not blocks:
        raise UserError(f"mixture-of-experts linears (e.g. {experts[0]}) are not supported yet: calibrate a dense model")
    groups = group_linears(linears)
    if not groups:
        raise UserError(f"{model_dir} has no linear layers to quantize")
    return groups


def _sequential_groups(model_dir, config) -> tuple[list[Group], int]:
    """The decision groups and the number of decoder layers, from the weightless model."""
    from resserve_export.stages.calibrate.sequential import decoder_layers, empty_model

    shell = empty_model(model_dir, config.dtype)
    return model_groups_of(shell, model_dir), len(decoder_layers(shell)[1])


def _score_spec(config):
    from resserve_export.stages.calibrate.sequential import ScoreSpec

    if config.scores != "grad":
        return None
    return ScoreSpec(list(RATIOS), config.format, config.mx_scale, config.score_precision, config.score_samples)


def _collect_sequential(model_dir, out, config, batches, show_progress, on_batch, key, resume):
    from resserve_export.storage.resume import ResumePoints
    from resserve_export.stages.calibrate.sequential import collect_sequential
    from resserve_export.core.ui import say

    groups, n_layers = _sequential_groups(model_dir, config)
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    points = ResumePoints.open(out, {**key, "groups": [list(g.modules) for g in groups]}, resume, say=say)
    spill = temp_sibling(out, "offload")
    passes = n_layers * (2 if config.scores == "grad" else 1)
    try:
        with Progress("calibrating layer by layer", passes, unit="layer passes", enabled=show_progress) as bar:
            done = [0]

            def step(li: int, bi: int, n: int) -> None:
                if bi == n - 1:
                    bar.advance(1)
                    done[0] += 1
                    if on_batch is not None:
                        on_batch(done[0])

            spec = _score_spec(config)

            def resumed(n: int) -> None:
                bar.start_at(n)
                done[0] = n

            stats, num_tokens, kv_stats, kv_problem, scores = collect_sequential(
                model_dir, config.device, config.dtype, batches, groups, spill, progress=step, scores=spec,
                resume=points, on_resume=resumed,
            )
    except UserError:
        points.finish()  # the same inputs would fail the same way
        raise
    except BaseException:
        # Interrupted, killed by the system, out of memory, disk full, ...: the state stays.
        where = points.where()
        if where is None:
            points.finish()  # nothing to continue from
        else:
            points.release()
            say(f"note: the run can continue from its last resume point ({where}): rerun the same command with --resume")
        raise
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    points.finish()
    return stats, num_tokens, kv_stats, kv_problem, groups, scores


def _collect_ranks_sequential(ranks, model_dir, out, config, batches, show_progress):
    """One data-parallel rank of the sequential pipeline: the layer passes over its share of the
    batches (and of the score samples), the statistics merged on rank 0 in global batch order
    between the forward and the backward passes and sent back to every rank (the candidates
    need them), then every score addition replayed on rank 0 in rank order: what one process
    computes. Returns (stats, num_tokens, kv statistics, why none, groups, scores or None)."""
    from resserve_export.algorithms.scores.batches import _take
    from resserve_export.stages.calibrate.sequential import collect_sequential

    stage = [0]  # 0: before the merge; 1: in it (its agreement done); 2: after it

    def combine(col, kvc):
        stage[0] = 1
        ranks.agree(None)
        merged = _merge_ranks(ranks, groups, col.parts(), kvc.result(), kvc.problem)
        stage[0] = 2
        return merged

    spec, log, spill, groups = _score_spec(config), {"adds": [], "tokens": 0}, None, []
    try:
        import torch

        groups, n_layers = _sequential_groups(model_dir, config)
        mine = ranks.share(batches)
        if not mine:
            raise UserError(f"{len(batches)} batches for {ranks.size} ranks: use more --num-samples or fewer ranks")
        score_mine, samples = None, 0
        if spec is not None:
            every = _take(batches, spec.samples, torch.device(config.device))
            samples = sum(int(b["input_ids"].shape[0]) for b in every)
            score_mine = ranks.share(every)
            if not score_mine:
                spec = None  # this rank adds nothing to the scores
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        spill = temp_sibling(out, "offload")
        passes = n_layers * (2 if spec is not None else 1)
        with Progress(f"calibrating layer by layer ({ranks.size} ranks)", passes, unit="layer passes", enabled=show_progress) as bar:

            def step(li: int, bi: int, n: int) -> None:
                if bi == n - 1:
                    bar.advance(1)

            stats, num_tokens, kv_stats, kv_problem, local = collect_sequential(
                model_dir, config.device, config.dtype, mine, groups, spill, progress=step, scores=spec,
                score_batches=score_mine, combine=combine, score_log=log,
            )
    except BaseException as e:
        if stage[0] != 1:
            ranks.agree(e)  # raises: this rank's error here, a one-line one on the others
        raise
    finally:
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
    ranks.agree(None)
    scores = _replay_scores(ranks, groups, log, local, samples, config) if config.scores == "grad" else None
    return stats, num_tokens, kv_stats, kv_problem, groups, scores


def _merge_ranks(ranks, groups, parts: dict, kv_stats, kv_problem) -> tuple:
    """Every rank's statistics (`StatsCollector.parts()`) and KV statistics, merged on rank 0 in
    one-process order (`distributed.merge_stats` / `merge_kv`) and sent to every rank: (stats,
    num_tokens, kv statistics, why none). A merge error is raised on every rank."""
    from resserve_export.core.distributed import merge_kv, merge_stats

    gathered = ranks.gather((parts, kv_stats, kv_problem))
    merged = None
    if ranks.rank == 0:
        try:
            every = [g[0] for g in gathered]
            merged = ("ok", merge_stats(every, groups), sum(p["tokens"] for p in every), merge_kv([g[1] for g in gathered]),
                      next((g[2] for g in gathered if g[2]), None))
        except UserError as e:
            merged = ("error", str(e))
    merged = ranks.broadcast(merged)
    if merged[0] == "error":
        raise UserError(merged[1])
    return merged[1:]


def _replay_scores(ranks, groups, log: dict, local: dict | None, samples: int, config) -> dict | None:
    """The grad scores record of one process, on rank 0 (None elsewhere): every rank's score
    additions (`log`) replayed in rank order, over all ranks' loss tokens."""
    from resserve_export.algorithms.scores import scores_record
    from resserve_export.algorithms.scores.grad import ScoreSums

    logs = ranks.gather({**log, "precision": local["precision"] if local else None, "seconds": local["wall_time_s"] if local else 0.0})
    if ranks.rank != 0:
        return None
    return scores_record(
        ScoreSums.replay(logs).normalised(groups, list(RATIOS), sum(x["tokens"] for x in logs)), groups, list(RATIOS), "grad",
        samples, config.format, config.mx_scale, next((x["precision"] for x in logs if x["precision"]), config.score_precision),
        max(x["seconds"] for x in logs),
    )


def _collect_ranks(ranks, model_dir, config, batches, shapes, show_progress):
    """One data-parallel rank of the whole-model pipeline (see `distributed`): statistics of
    its share of the batches, merged on rank 0 in global batch order and sent back to every
    rank; then grad scores of its share of the score samples, replayed on rank 0. Returns what
    `_collect_whole` returns (stats and scores as one process would compute them)."""
    import torch

    from resserve_export.observers import kvcache
    from resserve_export.modeling import modelio

    err, net = None, None
    try:
        net = modelio.load_model_on(model_dir, config.device, config.dtype)
        groups = model_groups_of(net, model_dir)
        # Every rank searches the same rows (the first of all batches) and gets the same scales.
        smoothing, weight_algo = _smooth(net, batches, groups, config, shapes, show_progress)
        mine = ranks.share(batches)
        with Progress(f"calibrating ({ranks.size} ranks)", len(mine), unit="batches", enabled=show_progress) as bar:
            kv = kvcache.KVCollector(net)
            parts, _ = collect(net, mine, groups, lambda n, t: bar.advance(1), kv=kv, parts=True)
            kv_local = kv.result()
    except BaseException as e:
        err = e
    ranks.agree(err)
    stats, num_tokens, kv_stats, kv_problem = _merge_ranks(ranks, groups, parts, kv_local, kv.problem)
    scores = None
    if config.scores == "grad":
        from resserve_export.algorithms.scores import compute_scores
        from resserve_export.algorithms.scores.batches import _take

        err, log = None, {"adds": [], "tokens": 0}
        try:
            score_batches = _take(batches, config.score_samples, torch.device(config.device))
            mine = ranks.share(score_batches)
            local = compute_scores(
                net, mine, stats, groups, "grad", list(RATIOS), config.format, None, rounding=config.mx_scale,
                show_progress=show_progress, precision=config.score_precision, log=log,
            ) if mine else None
        except BaseException as e:
            err = e
        ranks.agree(err)
        scores = _replay_scores(ranks, groups, log, local, sum(int(b["input_ids"].shape[0]) for b in score_batches), config)
    return stats, num_tokens, kv_stats, kv_problem, groups, smoothing, weight_algo, scores


def _smooth(net, batches, groups, config, shapes, show_progress, blocks=()):
    """With ``--weight-algo awq``: search the scales on `net` and smooth it in place, so that
    everything collected afterwards (salience, amax, KV statistics, expert statistics, scores)
    describes the smoothed model, with the values the checkpoint will store. `blocks`: a
    mixture-of-experts model's expert blocks. Returns (the `awq.Smoothing` or None,
    calibration.json's record)."""
    if config.weight_algo != "awq":
        return None, {"name": "rtn"}
    from resserve_export.algorithms.awq.smoothing import plan_folds, search_smoothing
    from resserve_export.modeling.experts import checkpoint_parameters

    blocks = list(blocks)
    with Progress("AWQ scale search", len(plan_folds(net, blocks, shapes)), unit="groups", enabled=show_progress) as bar:
        smoothing, record = search_smoothing(
            net, batches, groups, config.format, config.mx_scale, config.awq_tokens, progress=lambda: bar.advance(1),
            blocks=blocks, shapes=shapes, moe_calib=config.moe_calib,
        )
    # Experts as the slices of the fused parameters the collector computes with (checkpoint names).
    smoothing.apply_to_model(net, checkpoint_parameters(net, blocks))
    return smoothing, record


def _collect_whole(model_dir, out, config, batches, shapes, show_progress, on_batch, blocks=()):
    from resserve_export.observers import kvcache
    from resserve_export.modeling import modelio

    offload = None
    try:
        if config.device == "auto":
            out.absolute().parent.mkdir(parents=True, exist_ok=True)
            offload = temp_sibling(out, "offload")
        net = modelio.load_model_on(model_dir, config.device, config.dtype, offload_folder=offload)
        groups = model_groups_of(net, model_dir, blocks)
        smoothing, weight_algo = _smooth(net, batches, groups, config, shapes, show_progress, blocks)

        total = sum(int(b["input_ids"].shape[0]) for b in batches)
        with Progress("calibrating", total, unit="samples", rate_unit="tok", enabled=show_progress) as bar:
            done = [0]

            def step(n_samples: int, n_tokens: int) -> None:
                bar.advance(n_samples, rate=n_tokens)
                done[0] += 1
                if on_batch is not None:
                    on_batch(done[0])

            kv = kvcache.KVCollector(net)
            moe = None
            if blocks:
                from resserve_export.modeling.experts import ExpertCollector, is_expert

                dense = [g for g in groups if not is_expert(g.modules[0])]
                with ExpertCollector(net, list(blocks), config.moe_calib) as ec:
                    stats, num_tokens = collect(net, batches, dense, step, kv=kv, experts=ec)
                expert_stats, moe = ec.result()
                stats.update(expert_stats)
                _warn_fallbacks(ec.fallbacks)
            else:
                stats, num_tokens = collect(net, batches, groups, step, kv=kv)
            kv_stats = kv.result()

        scores = None
        if config.scores != "none":
            from contextlib import nullcontext

            from resserve_export.modeling.experts import unfused
            from resserve_export.algorithms.scores import compute_scores

            # Experts scored as per-expert linears under their checkpoint names, with the true routing.
            with unfused(net, list(blocks)) if blocks else nullcontext():
                scores = compute_scores(
                    net, batches, stats, groups, config.scores, list(RATIOS), config.format, config.score_samples,
                    rounding=config.mx_scale, show_progress=show_progress, precision=config.score_precision,
                )
    finally:
        if offload is not None:
            shutil.rmtree(offload, ignore_errors=True)
    return stats, num_tokens, kv_stats, kv.problem, groups, smoothing, weight_algo, scores, moe


def _warn_fallbacks(experts: list[str]) -> None:
    if experts:
        from resserve_export.core.ui import say

        more = f" and {len(experts) - 5} more" if len(experts) > 5 else ""
        say(
            f"warning: {len(experts)} experts saw no calibration token ({', '.join(experts[:5])}{more}): they take their "
            "layer's pooled expert statistics; calibrate with --moe-calib all or more samples for their own"
        )


def _is_linear(m) -> bool:
    import torch

    return isinstance(m, torch.nn.Linear)


def _quantized_linears(shapes) -> dict[str, tuple[int, int]]:
    from resserve_export.modeling.groups import linears_from_shapes

    return {k: v for k, v in linears_from_shapes(shapes).items() if is_quantized(k)}
