"""`calibrate --pipeline sequential --resume`: a run stopped anywhere (a crash after any layer
pass, forward or backward; SIGKILL; Ctrl-C) continues from its last resume point and writes
the bytes an uninterrupted run writes; bad uses are one-line errors."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from resserve_export.stages.calibrate import run as cal
from resserve_export.stages.calibrate.config import make_config
from resserve_export.core.errors import UserError
from resserve_export.storage.resume import RESUME_ENV, state_dir

from tests.fixtures.console import default_sigint
from tests.fixtures.models import make_llama, make_qwen3, varied_texts, write_jsonl


EXE = str(Path(sys.executable).parent / "resserve-export")
LAYERS = 3  # make_qwen3
# One worker runs the module: its model, the in-process reference and the fresh-process CLI
# reference are built once (split across two workers, each built all three: ~35 s more).
pytestmark = pytest.mark.xdist_group("resume")


class Crash(Exception):
    """Stands for what the system does to a long run (not a user error: the state is kept)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return make_qwen3(root / "qwen3"), write_jsonl(root / "docs.jsonl", varied_texts(10))


def _config(texts, **kw):
    kw = {"scores": "grad", "score_samples": 4, "score_precision": "fp32", "num_samples": 7, "seq_len": 48, "batch_size": 3, "pipeline": "sequential", **kw}
    return make_config("quick", dataset=str(texts), device="cpu", **kw)


def _run(model, out, texts, *, resume=False, crash_at=None, **kw):
    def on_pass(done: int) -> None:
        if crash_at is not None and done == crash_at:
            raise Crash(f"after {done} layer passes")

    return cal.calibrate(str(model), out, _config(texts, **kw), show_progress=False, on_batch=on_pass, resume=resume).path


def _same_output(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        if n == "calibration.json":
            ca, cb = (json.loads((d / n).read_text()) for d in (a, b))
            for k in ("num_tokens", "groups", "samples_sha256", "kv_cache", "pipeline", "fingerprint"):
                assert ca[k] == cb[k], k
        elif n == "scores.json":
            sa, sb = (json.loads((d / n).read_text()) for d in (a, b))
            assert sa["groups"] == sb["groups"] and sa["samples"] == sb["samples"]
            assert any(x > 0 for g in sa["groups"] for x in g["scores"].values())
        else:
            assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    model, texts = setup
    return _run(model, tmp_path_factory.mktemp("ref") / "calib", texts)


# Layer passes: 1..3 forward (layers 0, 1, 2), 4..6 backward (layers 2, 1, 0). A crash comes
# after the pass's progress report and before its resume point: the point is the pass before's
# (after the forward passes, one more once the loss's gradient is taken: backward, layer 3).
POINTS = {2: ("forward", 0), 3: ("forward", 1), 4: ("backward", 3), 5: ("backward", 2), 6: ("backward", 1)}


@pytest.mark.parametrize("crash_at", sorted(POINTS))
def test_a_run_crashed_after_any_layer_pass_resumes_to_the_same_bytes(setup, reference, crash_at, tmp_path, monkeypatch):
    model, texts = setup
    monkeypatch.setenv(RESUME_ENV, "0")  # a resume point after every layer
    out = tmp_path / "calib"
    with pytest.raises(Crash):
        _run(model, out, texts, crash_at=crash_at)
    assert not out.exists()
    state = state_dir(out)
    assert state.is_dir()
    meta = json.loads((state / "point" / "meta.json").read_text())
    assert (meta["phase"], meta["layer"]) == POINTS[crash_at]
    seen = []
    cal.calibrate(str(model), out, _config(texts), show_progress=False, on_batch=seen.append, resume=True)
    _same_output(reference, out)
    assert not state.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib"]
    # The resumed run continues the count where its resume point was.
    assert seen and seen[-1] == 2 * LAYERS and seen[0] > 1


def test_statistics_only_and_hidden_states_on_disk(setup, tmp_path, monkeypatch):
    model, texts = setup
    monkeypatch.setenv(RESUME_ENV, "0")
    monkeypatch.setenv("RESSERVE_HIDDEN_STORE", "disk")
    ref = _run(model, tmp_path / "ref", texts, scores="none")
    with pytest.raises(Crash):
        _run(model, tmp_path / "calib", texts, scores="none", crash_at=3)
    _run(model, tmp_path / "calib", texts, scores="none", resume=True)
    _same_output(ref, tmp_path / "calib")


def test_without_resume_a_saved_state_is_discarded(setup, reference, tmp_path, monkeypatch, capsys):
    model, texts = setup
    monkeypatch.setenv(RESUME_ENV, "0")
    out = tmp_path / "calib"
    with pytest.raises(Crash):
        _run(model, out, texts, crash_at=5)
    capsys.readouterr()
    _run(model, out, texts)
    err = capsys.readouterr().err
    assert f"note: discarding the state of an interrupted run of --out {out} (statistics done, scores of 1 of 3 layers done)" in err
    _same_output(reference, out)
    assert not state_dir(out).exists()


def test_no_resume_point_without_the_interval(setup, tmp_path, monkeypatch):
    model, texts = setup
    monkeypatch.setenv(RESUME_ENV, "off")
    out = tmp_path / "calib"
    with pytest.raises(Crash):
        _run(model, out, texts, crash_at=5)
    assert not state_dir(out).exists()
    monkeypatch.setenv(RESUME_ENV, "0")
    with pytest.raises(Crash):
        _run(model, out, texts, crash_at=1)  # before the first point
    assert not state_dir(out).exists()  # nothing to continue from: nothing left behind
    with pytest.raises(UserError, match="--resume: no interrupted layer-by-layer calibration of --out"):
        _run(model, out, texts, resume=True)


def test_bad_uses_are_one_line_errors(setup, tmp_path, monkeypatch):
    model, texts = setup
    out = tmp_path / "calib"
    with pytest.raises(UserError, match=f"--resume: no interrupted layer-by-layer calibration of --out {out} to continue: run without --resume"):
        _run(model, out, texts, resume=True)
    monkeypatch.setenv(RESUME_ENV, "0")
    with pytest.raises(Crash):
        _run(model, out, texts, crash_at=2)
    with pytest.raises(UserError, match=r"computed something else \(.*seq_len.*differ\): run without --resume to start over"):
        cal.calibrate(str(model), out, _config(texts, seq_len=40), show_progress=False, resume=True)
    with pytest.raises(UserError, match="--resume continues a layer-by-layer run: pass --pipeline sequential"):
        cal.calibrate(str(model), out, _config(texts, pipeline="whole"), show_progress=False, resume=True)
    # Another process holding the state.
    fd = os.open(state_dir(out) / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(UserError, match=f"another calibrate run is writing --out {out} now"):
            _run(model, out, texts, resume=True)
    finally:
        os.close(fd)
    monkeypatch.setenv(RESUME_ENV, "soon")
    with pytest.raises(UserError, match=f"{RESUME_ENV}='soon': use a number of seconds"):
        _run(model, out, texts, resume=True)
    # Refused uses leave the state as it was.
    assert json.loads((state_dir(out) / "point" / "meta.json").read_text())["layer"] == 0


def _cli(model, texts, out, *extra):
    return [EXE, "calibrate", str(model), "--dataset", str(texts), "--num-samples", "7", "--seq-len", "48", "--batch-size", "3",
            "--device", "cpu", "--config", "quick", "--pipeline", "sequential", "--scores", "grad", "--score-samples", "4",
            "--score-precision", "fp32", "--out", str(out), *extra]


def _wait_for_point(state: Path, proc: subprocess.Popen, ok) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        meta = state / "point" / "meta.json"
        if meta.is_file() and ok(json.loads(meta.read_text())):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("no resume point in time")


@pytest.fixture(scope="module")
def cli_reference(setup, tmp_path_factory):
    """The uninterrupted run as a user starts it: a fresh process, as the killed and resumed ones.
    (On CPUs with AVX-512, MKL's float32 GEMMs in a process that has run other calibrations can
    differ in the last bits from a fresh process's: measured on a Sapphire Rapids CPU, grad scores
    ~1e-4 apart; the in-process runs above compare with the in-process `reference`.)"""
    model, texts = setup
    out = tmp_path_factory.mktemp("cli-ref") / "calib"
    p = subprocess.run(_cli(model, texts, out), capture_output=True, text=True, env={**os.environ, "RESSERVE_LOG_SECONDS": "0"})
    assert p.returncode == 0, p.stderr[-2000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig, phase", [(signal.SIGKILL, "forward"), (signal.SIGKILL, "backward"), (signal.SIGINT, "forward")])
def test_a_killed_process_resumes_through_the_cli(setup, cli_reference, sig, phase, tmp_path):
    model, texts = setup
    out = tmp_path / "calib"
    env = {**os.environ, RESUME_ENV: "0", "RESSERVE_TEST_STEP_DELAY": "0.5", "RESSERVE_LOG_SECONDS": "0"}
    proc = subprocess.Popen(_cli(model, texts, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=default_sigint)
    _wait_for_point(state_dir(out), proc, lambda m: m["phase"] == phase and (phase == "backward" or m["layer"] >= 0))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and not out.exists()
    if sig == signal.SIGINT:
        assert proc.returncode == 130
        lines = err.strip().splitlines()
        assert lines[-1] == "interrupted: no output was written"
        assert lines[-2].startswith("note: the run can continue from its last resume point (layer ") and lines[-2].endswith("rerun the same command with --resume")
    env.pop("RESSERVE_TEST_STEP_DELAY")
    p = subprocess.run(_cli(model, texts, out, "--resume"), capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    # Progress of the resumed run starts where the point was, and shows an ETA.
    assert "calibrating layer by layer: 6/6 layer passes (100%)" in p.stderr
    _same_output(cli_reference, out)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["calib"]
    if sig == signal.SIGINT:
        # --resume with nothing to continue, through the script: the same command and the same
        # answer whichever run came before, so one of the three cases asks (a process start each).
        p = subprocess.run(_cli(model, texts, tmp_path / "other", "--resume"), capture_output=True, text=True, env=env)
        assert p.returncode == 2 and p.stderr.strip() == (
            f"error: --resume: no interrupted layer-by-layer calibration of --out {tmp_path / 'other'} to continue: run without --resume"
        )


def test_a_user_error_during_the_run_removes_the_state(setup, tmp_path, monkeypatch):

    _, texts = setup
    monkeypatch.setenv(RESUME_ENV, "0")
    poisoned = make_llama(tmp_path / "nan", dtype=torch.bfloat16, poison="model.layers.1.self_attn.q_proj.weight")
    out = tmp_path / "calib"
    with pytest.raises(UserError, match="non-finite"):
        _run(poisoned, out, texts, scores="none")
    assert not state_dir(out).exists() and not out.exists()


@pytest.mark.parametrize("fail_after", [0, 9])
def test_a_disk_that_refuses_a_resume_point_does_not_end_the_run(setup, reference, tmp_path, monkeypatch, capsys, fail_after):
    """Saving a point fails (disk full) at the first write, or in the middle of the backward
    points: the run goes on without new points, says so, and writes the reference bytes."""
    import errno

    from resserve_export.storage import resume

    model, texts = setup
    monkeypatch.setenv(RESUME_ENV, "0")
    calls = {"n": 0}
    real = resume._fsynced_save

    def full(obj, path):
        calls["n"] += 1
        if calls["n"] > fail_after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path)

    monkeypatch.setattr(resume, "_fsynced_save", full)
    out = tmp_path / "calib"
    _run(model, out, texts)
    err = capsys.readouterr().err
    assert err.count("warning: cannot save a resume point") == 1 and "(No space left on device): the run goes on without new ones" in err
    _same_output(reference, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib"]
