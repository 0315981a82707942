"""The tensors `pack` writes are pinned: restructuring the code must not move a single bit.

What is pinned is `pack` itself: the embedded SmolLM2-135M-Instruct packed from a fixed
calibration, `pack --format nvfp4 --plan` (the plan that `plan --budget 5.0` solves from fixed
scores) and `pack --format mxfp4 --ratio 0.25`. The calibration's statistics and scores are not
measured here but written from integer arithmetic: a bf16 forward pass on a CPU is not
bit-reproducible across processors and library releases (the same code pinned from a measured
calibration passed on one machine and failed on another), while everything `pack` computes from
a given calibration must be. The synthetic salience has many equal values inside a selection
group, so the ties of the top-k selection are pinned too.

The digests were computed with the code of commit 4cb5d66 (the commit that first pinned pack's
tensors, before the format registry and the module split) and agree with today's code. A digest
covers every tensor of the model shards and the sidecar: its file kind, name, dtype, shape and
bytes, in name order.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from resserve_export.cli import main

from tests.fixtures.tiny import group_list

PINNED = {
    "nvfp4-plan": "786619b234dd6d2c5aa590e3eb5244d9a15e53aeb1d2298af7f5633577830de4",
    "mxfp4-ratio-0.25": "44bb161194deff0c67829f2cf3e5853dbc236b82b6603a925b03ad02b9358c2c",
}
# How much a ratio keeps of a group's ratio-0 damage in the synthetic scores (decreasing in ρ).
SCORE_FRACTION = {"0": 1.0, "0.125": 0.875, "0.25": 0.75, "0.5": 0.5625, "1": 0.375}


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


def synthetic_calibration(calib: Path) -> None:
    """Replace the measured salience of `calib` by integer-derived values (in 1/64 steps, so
    float32 holds them exactly; 997 distinct values, so groups of 8 hold ties) and write fixed
    planner scores for every decision group."""
    meta = json.loads((calib / "calibration.json").read_text())
    path = calib / "salience.safetensors"
    with safe_open(str(path), "pt") as h:
        header, names = h.metadata(), set(h.keys())
        widths = {k[: -len(".mean_abs")]: h.get_slice(k).get_shape()[0] for k in names if k.endswith(".mean_abs")}
    tensors, groups = {}, []
    for gi, members in enumerate(meta["groups"]):
        c = torch.arange(widths[members[0]], dtype=torch.int64)
        mean_abs = ((c * 2654435761 + gi * 40503) % 997 + 1).to(torch.float32) / 64
        amax = torch.tensor(float(mean_abs.max()) * (2 + gi % 5), dtype=torch.float32)
        for m in members:
            tensors[f"{m}.mean_abs"], tensors[f"{m}.amax"] = mean_abs.clone(), amax.clone()
        damage = ((gi * 7919) % 101 + 1) / 1024
        groups.append({"modules": members, "scores": {r: damage * f for r, f in SCORE_FRACTION.items()}})
    assert set(tensors) == names
    save_file(tensors, str(path), metadata=header)
    weight_count = {tuple(g.modules): g.weight_count for g in group_list(Path(meta["model_dir"]))}
    for g in groups:
        g["weight_count"] = weight_count[tuple(g["modules"])]
    scores = {
        "method": "grad",
        "samples": 1,
        "tokens_normalised": True,
        "ratios": [float(r) for r in SCORE_FRACTION],
        "format": "nvfp4",
        "rounding": "ceil",
        "groups": groups,
        "fingerprint": meta["fingerprint"],
    }
    (calib / "scores.json").write_text(json.dumps(scores, indent=1))


# Under pytest-xdist (--dist loadgroup) both tests run on one worker: the calibration of the
# default model in `demo` is made once, not once per worker.
pytestmark = pytest.mark.xdist_group("checkpoint-bytes")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pinned")
    calib = d / "calib"
    cli("calibrate", "default", "--num-samples", "2", "--seq-len", "32", "--batch-size", "2", "--scores", "none", "--out", str(calib), "-q")
    synthetic_calibration(calib)
    cli("plan", "--calib", str(calib), "--budget", "5.0", "--out", str(calib / "plan.json"), "--no-chart")
    return d


@pytest.mark.slow
def test_demo_nvfp4_plan_checkpoint_bytes(demo):
    plan = json.loads((demo / "calib" / "plan.json").read_text())
    assert plan["achieved_bits"] == 5.0 and len({g["ratio"] for g in plan["groups"]}) > 2
    out = demo / "nvfp4"
    cli("pack", "default", "--calib", str(demo / "calib"), "--plan", str(demo / "calib" / "plan.json"), "--format", "nvfp4", "--out", str(out))
    assert tensor_digest(out) == PINNED["nvfp4-plan"]


@pytest.mark.slow
def test_demo_mxfp4_ratio_checkpoint_bytes(demo):
    out = demo / "mxfp4"
    cli("pack", "default", "--calib", str(demo / "calib"), "--ratio", "0.25", "--format", "mxfp4", "--out", str(out))
    assert tensor_digest(out) == PINNED["mxfp4-ratio-0.25"]
