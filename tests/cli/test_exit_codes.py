"""Every failure is one line and a non-zero exit, and nothing succeeds silently.

Real subprocesses of the installed console script where the process is the subject: Ctrl-C
(SIGINT) mid-run, unknown architectures, stale temporaries of killed runs, progress when piped,
file modes. What a command checks and says (unwritable outputs, the README's Usage lines as
written, verify's text source) goes through `run_main`, the same `cli.main` in this process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from resserve_export.core.ui import LOG_SECONDS_ENV, TEST_STEP_DELAY_ENV
from resserve_export.stages.pack.run import pack

from tests.fixtures.console import EXE, assert_one_line_error, default_sigint, leftovers, run, run_main
from tests.fixtures.models import make_llama, varied_texts, write_jsonl
from tests.fixtures.tiny import make_calibration, make_scores


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama with a real tokenizer (calibrate and verify tokenize text)."""
    return make_llama(tmp_path_factory.mktemp("exit") / "model", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("exit-texts") / "docs.jsonl", varied_texts(8))


@pytest.fixture(scope="module")
def packed(llama, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("exit-ckpt")
    calib = make_calibration(llama, root / "calib")
    make_scores(llama, calib)
    ckpt = root / "ckpt"
    pack(llama, calib, ckpt, "nvfp4", ratio=0.25, progress=False)
    return calib, ckpt


# ----------------------------------------------------------------------------- 1. Ctrl-C


def interrupt_when(args: list[str], ready: str, cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """Start the command, send SIGINT once `ready` appears on its stderr, return (code, stderr)."""
    env = {**os.environ, LOG_SECONDS_ENV: "0", TEST_STEP_DELAY_ENV: "0.5"}
    p = subprocess.Popen([EXE, *args], cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in p.stderr:
            lines.append(line)
            if ready in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(timeout), f"never saw {ready!r}: {''.join(lines)[-2000:]}"
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(10)
    return p.returncode, "".join(lines)


def _assert_interrupted(code: int, err: str, out: Path) -> None:
    assert code == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted: no output was written", err[-2000:]
    assert "Traceback" not in err
    assert leftovers(out) == [], leftovers(out)


def test_ctrl_c_during_calibrate(llama, texts, tmp_path):
    out = tmp_path / "calib"
    args = ["calibrate", str(llama), "--out", str(out), "--dataset", str(texts), "--num-samples", "8", "--seq-len", "32",
            "--batch-size", "1", "--device", "cpu", "--scores", "none"]
    _assert_interrupted(*interrupt_when(args, " elapsed", tmp_path), out)


def test_ctrl_c_during_pack(llama, packed, tmp_path):
    calib, _ = packed
    out = tmp_path / "ckpt"
    args = ["pack", str(llama), "--calib", str(calib), "--ratio", "0.25", "--out", str(out), "--device", "cpu"]
    _assert_interrupted(*interrupt_when(args, " elapsed", tmp_path), out)


def test_ctrl_c_during_verify(llama, packed, texts, tmp_path):
    calib, ckpt = packed
    out = tmp_path / "verify"
    args = ["verify", str(ckpt), "--model", str(llama), "--calib", str(calib), "--text", str(texts), "--samples", "2",
            "--seq-len", "32", "--device", "cpu", "--out", str(out)]
    _assert_interrupted(*interrupt_when(args, " elapsed", tmp_path), out)


# ----------------------------------------------------------------------------- 6. unknown architectures


@pytest.fixture(scope="module")
def alien(llama, tmp_path_factory) -> Path:
    """The tiny Llama's weights under an architecture transformers does not know."""
    d = tmp_path_factory.mktemp("alien") / "model"
    shutil.copytree(llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["FooBarForCausalLM"], model_type="foobar")
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_unknown_architecture_is_refused_by_calibrate(alien, texts, tmp_path):
    out = tmp_path / "calib"
    p = run("calibrate", str(alien), "--out", str(out), "--dataset", str(texts), "--num-samples", "2", "--device", "cpu")
    assert_one_line_error(p, 2, "FooBarForCausalLM", "foobar")
    assert leftovers(out) == []


def test_unknown_architecture_is_refused_by_pack(alien, llama, packed, tmp_path):
    calib, _ = packed
    out = tmp_path / "ckpt"
    p = run("pack", str(alien), "--calib", str(calib), "--ratio", "0", "--out", str(out))
    assert_one_line_error(p, 2, "FooBarForCausalLM")
    assert leftovers(out) == []


# ----------------------------------------------------------------------------- 7. unwritable outputs


def unwritable(tmp_path: Path) -> list[Path]:
    """Outputs that cannot be created even as root: below a regular file, and on /proc."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    return [blocker / "out", Path("/proc/resserve-no-such-dir/out")]


def test_unwritable_out_is_refused_before_any_work(llama, packed, texts, tmp_path):
    calib, ckpt = packed
    for out in unwritable(tmp_path):
        t0 = time.perf_counter()
        p = run_main("calibrate", str(llama), "--out", str(out), "--dataset", str(texts), "--num-samples", "64", "--seq-len", "256",
                     "--device", "cpu", env={TEST_STEP_DELAY_ENV: "5"})
        assert_one_line_error(p, 2, "cannot write --out", str(out))
        assert time.perf_counter() - t0 < 60  # refused up front, not after 64 slowed samples
        assert_one_line_error(run_main("plan", "--calib", str(calib), "--budget", "5", "--out", str(out / "plan.json")), 2, "cannot write")
        p = run_main("verify", str(ckpt), "--model", str(llama), "--calib", str(calib), "--text", str(texts), "--out", str(out))
        assert_one_line_error(p, 2, "cannot write --out")
        assert_one_line_error(run_main("pack", str(llama), "--calib", str(calib), "--ratio", "0", "--out", str(out)), 2, "cannot write")


def test_oserror_during_a_run_is_one_line(tmp_path, monkeypatch, capsys):
    """An OSError after the up-front checks (here: the plan file's directory vanishes) names the path."""
    from resserve_export.stages import plan as P
    from resserve_export.cli import main

    def boom(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "x" / "plan.json"))

    scores = {"method": "grad", "format": "nvfp4", "rounding": "ceil",
              "groups": [{"modules": ["l.0.a"], "weight_count": 64, "scores": {"0": 1.0, "0.25": 0.5}}]}
    (tmp_path / "scores.json").write_text(json.dumps(scores))
    monkeypatch.setattr(P, "write_file_atomic", boom)
    with pytest.raises(SystemExit) as e:
        main(["plan", "--calib", str(tmp_path), "--budget", "5"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "\n" not in err and "Permission denied" in err and str(tmp_path / "x" / "plan.json") in err, err


# ----------------------------------------------------------------------------- 9. stale temporaries


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_calibrate_removes_temporaries_of_killed_runs(llama, texts, tmp_path):
    out = tmp_path / "calib"
    pid = dead_pid()
    stale = [tmp_path / f".calib.tmp-{pid}-abc", tmp_path / f".calib.offload-{pid}-def"]
    live = tmp_path / f".calib.tmp-{os.getpid()}-ghi"  # a run that is still going: kept
    for d in (*stale, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"0" * 1024)
    p = run("calibrate", str(llama), "--out", str(out), "--dataset", str(texts), "--num-samples", "2", "--seq-len", "32",
            "--device", "auto", "--scores", "none", "-q")
    assert p.returncode == 0, p.stderr[-2000:]
    assert leftovers(out) == [live.name, "calib"]


# ----------------------------------------------------------------------------- 11. usability


def test_help_shows_defaults_and_no_bool_placeholder():
    # Every command's help through cli.main in this process; the installed script once (below).
    for cmd in ("calibrate", "plan", "pack", "verify", "size", "inspect"):
        p = run_main(cmd, "--help", env={"COLUMNS": "200"})
        assert p.returncode == 0, p.stderr
        assert "Usage:" in p.stdout and "<bool>" not in p.stdout, cmd
    p = run("calibrate", "--help", env={"COLUMNS": "200"})
    assert p.returncode == 0 and "<bool>" not in p.stdout, p.stderr
    text = p.stdout
    for default in ("[default: paper]", "[default: 1024 (paper preset)]", "[default: 2048 (paper preset)]", "[default: grad]",
                    "[default: 32 (paper preset)]", "[default: nvfp4]", "[default: ceil]"):
        assert default in text, default


def test_progress_lines_when_piped(llama, texts, tmp_path):
    p = run("calibrate", str(llama), "--out", str(tmp_path / "c"), "--dataset", str(texts), "--num-samples", "4",
            "--seq-len", "32", "--batch-size", "1", "--device", "cpu", env={LOG_SECONDS_ENV: "0"})
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [l for l in p.stderr.splitlines() if l.startswith("calibrating: ")]
    assert [re.search(r": (\d)/4 samples", l).group(1) for l in lines] == ["1", "2", "3", "4", "4"], p.stderr
    assert "tok/s" in lines[0] and "ETA" in lines[0] and "elapsed" in lines[-1]
    assert any(l.startswith("scoring (grad") for l in p.stderr.splitlines()), p.stderr


def test_readme_usage_lines_run_as_written(llama, texts, tmp_path, monkeypatch):
    """calibrate -> plan -> pack of the README's Usage block, MODEL replaced by a tiny model and
    calibrate shortened (its defaults are the published protocol); every other flag as written."""
    usage = (ROOT / "README.md").read_text().split("## Usage", 1)[1].split("```")[1]
    lines = [l.split("#")[0].split() for l in usage.strip().splitlines()]
    assert [l[1] for l in lines[:3]] == ["calibrate", "plan", "pack"]
    short = ["--dataset", str(texts), "--num-samples", "4", "--seq-len", "32", "--score-samples", "2", "--device", "cpu"]
    monkeypatch.chdir(tmp_path)  # the lines name relative outputs
    for argv in lines[:3]:
        args = [str(llama) if a == "MODEL" else a for a in argv[1:]]
        p = run_main(*args, *(short if argv[1] == "calibrate" else []))
        assert p.returncode == 0, (argv, p.stderr[-2000:])
    assert (tmp_path / "calib" / "scores.json").exists() and (tmp_path / "ckpt" / "config.json").exists()


def test_plan_files_have_normal_modes(tmp_path):
    old = os.umask(0o022)
    try:
        scores = {"method": "grad", "format": "nvfp4", "rounding": "ceil",
                  "groups": [{"modules": ["model.layers.0.mlp.down_proj"], "weight_count": 64, "scores": {"0": 1.0, "0.25": 0.5}}]}
        (tmp_path / "scores.json").write_text(json.dumps(scores))
        p = run("plan", "--calib", str(tmp_path), "--budget", "5")
        assert p.returncode == 0, p.stderr
    finally:
        os.umask(old)
    for name in ("plan.json", "plan.png"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name


def test_verify_with_text_needs_no_default_text(llama, packed, texts, tmp_path):
    """Without --calib the sweep's selection comes from --text, so the default plays are not needed."""
    _, ckpt = packed
    out = tmp_path / "v"
    p = run_main("verify", str(ckpt), "--model", str(llama), "--text", str(texts), "--samples", "2", "--seq-len", "32",
                 "--device", "cpu", "--out", str(out), env={"RESSERVE_TEXTS": str(tmp_path / "no-texts-here")})
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads((out / "verify.json").read_text())
    assert rep["sweep_selection"] == f"salience from 16 samples (seed 1) of {texts} (seq_len 32)"
    assert rep["weights_match_reference"] is True
