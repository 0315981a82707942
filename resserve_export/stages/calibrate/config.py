"""Calibration settings: `CalibConfig`, the packaged presets (``calib_configs/*.yaml``) and
`make_config`, which lays command-line flags over a preset."""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from resserve_export.algorithms.awq.smoothing import check_weight_algo
from resserve_export.algorithms.gptq import ORDER as GPTQ_ORDER
from resserve_export.algorithms.gptq import ORDERS as GPTQ_ORDERS
from resserve_export.algorithms.scores import PRECISIONS as SCORE_PRECISIONS
from resserve_export.algorithms.scores.device import fast_bf16
from resserve_export.core import devices
from resserve_export.core.errors import UserError
from resserve_export.core.ui import say
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.registry import FORMATS
from resserve_export.modeling.experts import MOE_CALIB
from resserve_export.stages.calibrate.sequential import PIPELINES

# The presets: the repository's calib_configs/, installed as the package data of
# resserve_export.calib_configs (pyproject's package-dir), so bare names work from a wheel too.
CONFIG_DIR = importlib.resources.files("resserve_export.calib_configs")
SCORE_METHODS = ("none", "grad", "kl")
# The dtypes ``--dtype`` loads a model in (torch names; the safetensors dtype table is
# storage.safetensors.ST_DTYPES).
LOAD_DTYPES = ("bfloat16", "float16", "float32", "float64")


@dataclass
class CalibConfig:
    """Calibration settings. Defaults are the published protocol (docs/formats.md,
    "Calibration"), as in calib_configs/paper.yaml."""

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
    gptq_order: str = GPTQ_ORDER
    gptq_propagate: bool = False
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
        roundings = [r.value for r in ScaleRounding]
        if self.mx_scale not in roundings:
            raise UserError(f"--mx-scale must be one of {', '.join(roundings)}, got {self.mx_scale!r}")
        if self.score_precision not in SCORE_PRECISIONS:
            raise UserError(f"--score-precision must be one of {', '.join(SCORE_PRECISIONS)}, got {self.score_precision!r}")
        if self.dtype not in LOAD_DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(LOAD_DTYPES)}, got {self.dtype!r}")
        check_weight_algo(self.weight_algo)
        if self.gptq_order not in GPTQ_ORDERS:
            raise UserError(f"--gptq-order must be one of {', '.join(GPTQ_ORDERS)}, got {self.gptq_order!r}")
        if not isinstance(self.gptq_propagate, bool):
            raise UserError(f"gptq_propagate must be true or false, got {self.gptq_propagate!r}")
        if self.gptq_propagate and self.weight_algo != "gptq":
            raise UserError(f"--gptq-propagate goes with --weight-algo gptq, not {self.weight_algo}")
        if self.gptq_propagate and self.pipeline == "whole":
            raise UserError("--gptq-propagate runs layer by layer: pass --pipeline sequential (or auto), not whole")
        if self.pipeline not in PIPELINES:
            raise UserError(f"--pipeline must be one of {', '.join(PIPELINES)}, got {self.pipeline!r}")
        if self.moe_calib not in MOE_CALIB:
            raise UserError(f"--moe-calib must be one of {', '.join(MOE_CALIB)}, got {self.moe_calib!r}")
        return self


def preset_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in CONFIG_DIR.iterdir() if p.name.endswith(".yaml") and p.is_file())


def load_preset(name_or_path: str) -> dict:
    """Settings from a preset: a YAML path, or a bare name of a packaged preset (``calib_configs/NAME.yaml``)."""
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


def note_slow_bf16(config: CalibConfig) -> None:
    """Say once, as the work starts (every check passed), when bf16 will be slow: a CPU without
    AVX512-BF16 or AMX runs bf16 GEMMs several times slower than float32 ones (SmolLM2-135M's
    quick preset: 526 s against 61 s on a 2-core AVX2 machine)."""
    device = devices.resolve_device(config.device)
    if device.type == "cpu" and config.dtype == "bfloat16" and not fast_bf16(device):
        say(
            "note: this CPU has no AVX512-BF16 or AMX, so bf16 runs several times slower than float32 here; "
            "--dtype float32 calibrates faster (its statistics differ from bf16's in the last bits)"
        )
