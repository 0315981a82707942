"""Bad input to `pack`: one-line error, non-zero exit, nothing left behind. Plus interrupted
packs (SIGKILL) and a full disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from resserve_export.storage import safetensors
from resserve_export.cli import main
from resserve_export.core.errors import UserError
from resserve_export.core.ui import TEST_STEP_DELAY_ENV
from resserve_export.stages.pack.run import pack
from resserve_export.storage import checkpoint

from tests.fixtures.checkpoints import fail_writes_after
from tests.fixtures.tiny import make_calibration, make_model, plan_fields


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    model = make_model(root / "model")
    return model, make_calibration(model, root / "calib")


def _run(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    return e.value.code, err


def _assert_user_error(argv, capsys, out: Path, *needles: str) -> str:
    code, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    # nothing left behind: no output, no partial sibling
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*"))
    return lines[0]


def _argv(model, calib, out, *extra):
    return ["pack", str(model), "--calib", str(calib), "--out", str(out), *extra]


def test_calibration_missing_a_layer(tiny, tmp_path, capsys):
    model, _ = tiny
    calib = make_calibration(model, tmp_path / "c", drop=("model.layers.1.mlp.down_proj",))
    out = tmp_path / "ck"
    _assert_user_error(_argv(model, calib, out, "--ratio", "0.25"), capsys, out, "model.layers.1.mlp.down_proj", "calibrate")


def test_calibration_from_another_model(tiny, tmp_path, capsys):
    model, _ = tiny
    calib = make_calibration(model, tmp_path / "c", fingerprint="0" * 64)
    out = tmp_path / "ck"
    _assert_user_error(_argv(model, calib, out, "--ratio", "0.25"), capsys, out, "other weights", "--allow-other-weights")
    # The explicit override packs it anyway.
    pack(model, calib, out, "nvfp4", ratio=0.25, allow_other_weights=True, progress=False)
    assert (out / "config.json").exists()


def test_not_a_calibration_dir(tiny, tmp_path, capsys):
    model, _ = tiny
    out = tmp_path / "ck"
    _assert_user_error(_argv(model, tmp_path, out, "--ratio", "0.25"), capsys, out, "calibrate")


def test_plan_for_another_model(tiny, tmp_path, capsys):
    model, calib = tiny
    out = tmp_path / "ck"
    plan = tmp_path / "plan.json"
    same = plan_fields(model)
    plan.write_text(json.dumps({"budget": 5, **same, "groups": [{"modules": ["model.layers.0.mlp.fc1"], "ratio": 0.25}]}))
    _assert_user_error(_argv(model, calib, out, "--plan", str(plan)), capsys, out, "another model")
    plan.write_text(json.dumps({"budget": 5, **same, "fingerprint": "f" * 64, "groups": []}))
    _assert_user_error(_argv(model, calib, out, "--plan", str(plan)), capsys, out, "other weights", "--allow-other-weights")


@pytest.mark.parametrize("ratio", ["0.3", "2", "-0.125"])
def test_ratio_outside_allowed_set(tiny, tmp_path, capsys, ratio):
    model, calib = tiny
    out = tmp_path / "ck"
    _assert_user_error(_argv(model, calib, out, "--ratio", ratio), capsys, out, "0.125", "0.25")


def test_ratio_and_plan_both_or_neither(tiny, tmp_path, capsys):
    model, calib = tiny
    out = tmp_path / "ck"
    _assert_user_error(_argv(model, calib, out), capsys, out, "--ratio", "--plan")


def test_experts_pack_cannot_quantize_completely_are_refused_first(tmp_path, capsys):
    """Experts whose projections are not gate / up / down are refused before the calibration is
    even read (here there is none): never a checkpoint with some experts left in bf16."""
    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "tie_word_embeddings": False}))
    t = {"model.embed_tokens.weight": torch.zeros(16, 32, dtype=torch.bfloat16)}
    for e in range(2):
        for p in ("w_in", "w_out"):
            t[f"model.layers.0.mlp.experts.{e}.{p}.weight"] = torch.zeros(32, 32, dtype=torch.bfloat16)
    save_file(t, str(model / "model.safetensors"))
    out = tmp_path / "ck"
    _assert_user_error(
        _argv(model, tmp_path, out, "--ratio", "0"), capsys, out, "model.layers.0.mlp.experts.0 holds w_in, w_out, not gate / up / down",
        "nothing was packed",
    )


def test_corrupted_input_shard(tiny, tmp_path, capsys):
    model, calib = tiny
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # truncated download
    out = tmp_path / "ck"
    _assert_user_error(_argv(bad, calib, out, "--ratio", "0.25"), capsys, out, "model.safetensors", "corrupted")
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[24:])
    _assert_user_error(_argv(bad, calib, out, "--ratio", "0.25"), capsys, out, "corrupted")


def test_existing_out_needs_overwrite(tiny, tmp_path, capsys):
    model, calib = tiny
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    code, err = _run(_argv(model, calib, out, "--ratio", "0"), capsys)
    assert code == 2 and err.count("\n") == 1 and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "user data"
    main(_argv(model, calib, out, "--ratio", "0", "--overwrite"))
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert not list(tmp_path.glob(".ck.*"))


def test_out_of_disk_space(tiny, tmp_path, monkeypatch):
    model, calib = tiny
    calls = fail_writes_after(monkeypatch, 5, errno.ENOSPC, "No space left on device")
    out = tmp_path / "ck"
    with pytest.raises(UserError) as e:
        pack(model, calib, out, "nvfp4", ratio=0.25, progress=False)
    msg = str(e.value)
    assert "no space left" in msg and "\n" not in msg and "free space" in msg
    assert calls["n"] > 5
    assert not out.exists() and not list(tmp_path.glob(".ck.*"))


def test_sigkill_leaves_nothing_complete_and_rerun_succeeds(tiny, tmp_path):
    model, calib = tiny
    out = tmp_path / "ck"
    env = {**os.environ, TEST_STEP_DELAY_ENV: "0.3"}
    cmd = [sys.executable, "-m", "resserve_export.cli", *_argv(model, calib, out, "--ratio", "0.25")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        partial = []
        while time.time() < deadline:
            partial = [p for p in tmp_path.glob(".ck.tmp-*") if list(p.glob("model-*.safetensors"))]
            if partial:
                break
            assert proc.poll() is None, "pack finished before it could be killed"
            time.sleep(0.1)
        assert partial, "no partial directory appeared"
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists()
    # the leftover is hidden and has no config.json: nothing looks like a checkpoint
    assert all(not (p / "config.json").exists() for p in partial)
    pack(model, calib, out, "nvfp4", ratio=0.25, progress=False)
    assert (out / "config.json").exists() and (out / "model.safetensors.index.json").exists()
    assert not list(tmp_path.glob(".ck.tmp-*"))  # the dead run's leftovers are cleaned


def test_non_finite_or_zero_input_amax_is_refused_with_the_layer(tiny, tmp_path, capsys):
    model, _ = tiny
    for bad in (float("nan"), float("inf"), 0.0):
        calib = make_calibration(model, tmp_path / f"c{bad}")
        t = load_file(str(calib / "salience.safetensors"))
        t["model.layers.1.self_attn.o_proj.amax"] = torch.tensor(bad)
        save_file(t, str(calib / "salience.safetensors"))
        out = tmp_path / "ck"
        _assert_user_error(_argv(model, calib, out, "--ratio", "0.25"), capsys, out, "model.layers.1.self_attn.o_proj", "re-run calibrate")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_non_finite_weights_are_refused_with_the_layer(tiny, tmp_path, capsys, fmt):
    model, calib = tiny
    bad = tmp_path / "model"
    shutil.copytree(model, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.weight"][3, 5] = float("inf")
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "ck"
    argv = [*_argv(bad, calib, out, "--ratio", "0.25"), "--format", fmt, "--allow-other-weights"]
    _assert_user_error(argv, capsys, out, "up_proj", "NaN or Inf")


@pytest.mark.parametrize(
    "device, needle",
    [
        ("tpu", "unknown --device 'tpu'"),
        pytest.param(
            "cuda:0", "--device cuda:0",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without a CUDA GPU"),
        ),
    ],
)
def test_device_is_parsed_as_by_every_command(tiny, tmp_path, capsys, device, needle):
    """pack takes the same --device values as calibrate and verify (auto, cpu, cuda, cuda:N)."""
    model, calib = tiny
    out = tmp_path / "ck"
    _assert_user_error([*_argv(model, calib, out, "--ratio", "0"), "--device", device], capsys, out, needle)


def test_pack_takes_the_groups_calibrate_recorded(tiny, tmp_path):
    """Which linears are quantized, and which share an input, is calibrate's decision (recorded in
    calibration.json), not re-derived from the headers: unfused q/k/v stay three groups."""
    model, calib = tiny
    c = tmp_path / "c"
    shutil.copytree(calib, c)
    meta = json.loads((c / "calibration.json").read_text())
    split = []
    for g in meta["groups"]:
        split += [[m] for m in g] if g[0].endswith("q_proj") else [g]
    meta["groups"] = split
    (c / "calibration.json").write_text(json.dumps(meta))
    out = pack(model, c, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    records = json.loads((out / "config.json").read_text())["quantization_config"]["resserve"]["groups"]
    assert sorted(r["members"] for r in records) == sorted(split)
    meta["groups"][0] = ["model.layers.0.self_attn.no_such_proj"]
    (c / "calibration.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="no_such_proj, which has no 2-D weight in this model"):
        pack(model, c, tmp_path / "ck2", "nvfp4", ratio=0.25, progress=False)
