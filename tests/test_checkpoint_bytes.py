"""The tensors `pack` writes are pinned: restructuring the code must not move a single bit.

The digests were computed at commit 3127683 (before the format registry and the module split)
from the demo pipeline on the embedded SmolLM2-135M-Instruct: `calibrate --config quick --scores
grad`, `plan --budget 5.0`, `pack --format nvfp4 --plan`, and `pack --format mxfp4 --ratio 0.25`
from the same calibration. A digest covers every tensor of the model shards and the sidecar:
its file kind, name, dtype, shape and bytes, in name order.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from resserve_export.cli import main

PINNED = {
    "nvfp4-plan": "34881556c7f1d353ef7d940dbcba0b9cdd7ddff6604098e3847a5739b1480e08",
    "mxfp4-ratio-0.25": "078cb399444efc35d4064f260bf7e3e76e6f17810b8ba8d81274ce92f5a4a290",
}


def tensor_digest(ckpt: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        for name in sorted(header):
            e = header[name]
            a, b = e["data_offsets"]
            h.update(json.dumps([f.name.split("-")[0], name, e["dtype"], e["shape"]]).encode())
            h.update(raw[8 + n + a : 8 + n + b])
    return h.hexdigest()


def cli(*args: str) -> None:
    try:
        main(list(args))
    except SystemExit as e:
        assert e.code in (0, None), args


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pinned")
    cli("calibrate", "default", "--config", "quick", "--scores", "grad", "--out", str(d / "calib"), "-q")
    cli("plan", "--calib", str(d / "calib"), "--budget", "5.0", "--out", str(d / "calib" / "plan.json"), "--no-chart")
    return d


@pytest.mark.slow
def test_demo_nvfp4_plan_checkpoint_bytes(demo):
    out = demo / "nvfp4"
    cli("pack", "default", "--calib", str(demo / "calib"), "--plan", str(demo / "calib" / "plan.json"), "--format", "nvfp4", "--out", str(out))
    assert tensor_digest(out) == PINNED["nvfp4-plan"]


@pytest.mark.slow
def test_demo_mxfp4_ratio_checkpoint_bytes(demo):
    out = demo / "mxfp4"
    cli("pack", "default", "--calib", str(demo / "calib"), "--ratio", "0.25", "--format", "mxfp4", "--out", str(out))
    assert tensor_digest(out) == PINNED["mxfp4-ratio-0.25"]
