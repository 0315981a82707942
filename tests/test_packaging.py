"""The built wheel ships what an installed tool needs, and nothing that shadows other packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_kernel_sources_inside_the_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("resserve_export-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in (ROOT / "kernels").iterdir():
        assert f"resserve_export/_kernels/{src.name}" in names
    # A top-level `kernels` would shadow Hugging Face's `kernels` package, which transformers probes for.
    assert not any(n.startswith("kernels/") for n in names)
    assert "planners/ilp.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "resserve-export = resserve_export.cli:main" in text
    assert "resserve = resserve_export.vllm_plugin:register" in text
