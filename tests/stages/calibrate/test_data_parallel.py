"""`torchrun --no-python --nproc-per-node N resserve-export calibrate …`: data-parallel ranks (gloo
on CPU here) write what one process writes, bit for bit (statistics, KV-cache amax, AWQ scales,
grad scores; same thread count), and a failing rank ends every rank with one line and no output."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.models import make_llama, varied_texts, write_jsonl


BIN = Path(sys.executable).parent
EXE = str(BIN / "resserve-export")
TORCHRUN = str(BIN / "torchrun")
pytestmark = [pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed"), pytest.mark.slow]
# One intra-op thread everywhere: GEMMs with other thread counts round differently (the
# statistics hooks do not, the backward pass of the grad scores does).
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, script: list[str] | None = None) -> subprocess.CompletedProcess:
    head = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd = head + (script if script else ["--no-python", EXE]) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    return make_llama(root / "llama", dtype=torch.bfloat16), write_jsonl(root / "docs.jsonl", varied_texts(12))


def args(model, texts, out, *extra) -> list[str]:
    return ["calibrate", str(model), "--dataset", str(texts), "--num-samples", "9", "--seq-len", "48", "--batch-size", "2",
            "--device", "cpu", "--config", "quick", "--out", str(out), "-q", *extra]


@pytest.mark.parametrize(
    "extra",
    [
        ["--scores", "grad", "--score-samples", "5"],
        ["--scores", "none", "--weight-algo", "awq", "--awq-tokens", "64"],
        ["--scores", "grad", "--score-samples", "5", "--pipeline", "sequential"],
    ],
)
def test_two_ranks_write_what_one_process_writes(setup, tmp_path, extra):
    """Each rank runs the pipeline (whole model, or layer by layer) on its share."""
    model, texts = setup
    one = subprocess.run([EXE, *args(model, texts, tmp_path / "one", *extra)], capture_output=True, text=True, env=ENV)
    assert one.returncode == 0, one.stderr[-2000:]
    two = torchrun(*args(model, texts, tmp_path / "two", *extra))
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("wrote ") == 1  # rank 0 reports
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir())
    for f in files:
        if f == "calibration.json":
            continue
        a, b = (tmp_path / "one" / f).read_bytes(), (tmp_path / "two" / f).read_bytes()
        if f == "scores.json":
            a, b = (json.loads(x) for x in (a, b))
            assert a["groups"] == b["groups"] and a["samples"] == b["samples"] == 5
        else:
            assert a == b, f
    c1, c2 = (json.loads((tmp_path / d / "calibration.json").read_text()) for d in ("one", "two"))
    assert c2["data_parallel"] == {"ranks": 2, "backend": "gloo"} and "data_parallel" not in c1
    assert c2["pipeline"] == ("sequential" if "sequential" in extra else "whole")
    for k in ("num_tokens", "samples_sha256", "groups", "kv_cache", "weight_algo"):
        assert c1[k] == c2[k], k


def _error_lines(p: subprocess.CompletedProcess) -> list[str]:
    """Our ranks' one-line errors. torchrun then stops the other ranks (SIGTERM) and prints its
    own failure report, which is torchrun's and not ours: no frame of it is in our code."""
    assert not [line for line in p.stderr.splitlines() if line.strip().startswith("File ") and "resserve_export" in line], p.stderr[-3000:]
    return [line for line in p.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize(
    "where, extra",
    [
        ("statistics", ["--scores", "none"]),
        ("statistics", ["--scores", "none", "--pipeline", "sequential"]),
        # After the statistics were merged, in the layer-by-layer backward pass.
        ("scores", ["--scores", "grad", "--score-samples", "5", "--pipeline", "sequential"]),
    ],
)
def test_a_failing_rank_ends_every_rank_with_one_line(setup, tmp_path, where, extra):
    model, texts = setup
    script = [str(Path(__file__).parent / "dp_scripts" / "fail_on_rank.py"), "1", where]
    p = torchrun(*args(model, texts, tmp_path / "out", *extra), script=script)
    assert p.returncode != 0
    lines = _error_lines(p)
    assert "error: injected failure on rank 1" in lines
    # Rank 0 says so too, unless torchrun stopped it first.
    assert set(lines) <= {"error: injected failure on rank 1", "error: rank 1 of 2 failed (its message above): nothing was written"}
    assert not (tmp_path / "out").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == []


def test_every_rank_failing_and_refusals(setup, tmp_path):
    model, texts = setup
    poisoned = make_llama(tmp_path / "nan", dtype=torch.bfloat16, poison="model.layers.0.self_attn.q_proj.weight")
    p = torchrun(*args(poisoned, texts, tmp_path / "out", "--scores", "none"))
    assert p.returncode != 0 and not (tmp_path / "out").exists()
    lines = _error_lines(p)
    assert lines and all("non-finite" in line for line in lines)
    p = torchrun(*args(model, texts, tmp_path / "out", "--scores", "none", "--pipeline", "sequential", "--resume"))
    assert p.returncode != 0
    lines = _error_lines(p)
    assert lines and all(line == "error: --resume does not run under torchrun: run it in one process" for line in lines)
    # A rank failing in the middle of the layer passes (non-finite activations on every rank).
    p = torchrun(*args(poisoned, texts, tmp_path / "out", "--scores", "grad", "--score-samples", "5", "--pipeline", "sequential"))
    assert p.returncode != 0 and not (tmp_path / "out").exists()
    lines = _error_lines(p)
    assert lines and all("non-finite" in line for line in lines)
    shutil.rmtree(tmp_path / "nan")
    assert not (tmp_path / "out").exists()
