"""The calibration directory's statistics file (salience.safetensors) and the provenance it records."""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

from safetensors.torch import load_file, save_file

from resserve_export import __version__
from resserve_export.core.errors import UserError


def save_stats(stats: dict[str, dict], path: Path) -> None:

    tensors = {}
    for m in sorted(stats):
        tensors[f"{m}.mean_abs"] = stats[m]["mean_abs"].contiguous()
        tensors[f"{m}.amax"] = stats[m]["amax"].contiguous()
    # One metadata key only: safetensors writes several in random order (files must be byte-identical).
    save_file(tensors, str(path), metadata={"resserve_salience": "1"})


def load_stats(calib_dir: Path) -> dict[str, dict]:
    """Read ``salience.safetensors`` back as ``{module: {"mean_abs": ..., "amax": ...}}``."""

    path = Path(calib_dir) / "salience.safetensors"
    if not path.is_file():
        raise UserError(f"{calib_dir} is not a calibration directory (no salience.safetensors): run `resserve-export calibrate` first")
    out: dict[str, dict] = {}
    for k, v in load_file(str(path)).items():
        mod, _, field = k.rpartition(".")
        out.setdefault(mod, {})[field] = v
    return out


def versions() -> dict[str, str]:


    out = {"resserve-export": __version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "datasets", "accelerate", "safetensors"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out
