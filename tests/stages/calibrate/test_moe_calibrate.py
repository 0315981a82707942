"""`calibrate` on mixture-of-experts models: Qwen2-MoE's shared expert and its gate, grad scores for
every expert, and what MoE calibration refuses (GPT-OSS, options it does not support yet)."""

from __future__ import annotations

import json

import pytest
import torch

from resserve_export.formats import nvfp4
from resserve_export.modeling import modelio
from resserve_export.modeling.experts import expert_blocks
from resserve_export.stages.pack.run import pack
from resserve_export.storage.checkpoint import read_checkpoint

from tests.fixtures.console import assert_one_line_error, leftovers, run_main
from tests.fixtures.moe import calibrated
from tests.fixtures.tiny import make_calibration

# The session's MoE models and their cached calibrations (tests.fixtures.moe) are built once:
# under pytest-xdist (--dist loadgroup) every MoE test runs on one worker.
pytestmark = pytest.mark.xdist_group("moe")



def test_qwen2_moe_shared_expert_and_its_gate(moe, tmp_path):
    """Qwen2-MoE: the shared expert (read as [B·T, H] rows) is a dense MLP calibrated without
    padding; its sigmoid gate stays bf16 and unquantized, like the router."""
    model = moe["models"]["qwen2_moe"]
    calib = calibrated(moe, "qwen2_moe")
    rec = json.loads((calib / "calibration.json").read_text())
    assert ["model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj"] in rec["groups"]
    assert not any("shared_expert_gate" in m for g in rec["groups"] for m in g)
    out = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["ignore"] == ["lm_head"] + [f"model.layers.{i}.mlp.{x}" for i in (0, 1) for x in ("gate", "shared_expert_gate")]
    packed = read_checkpoint(out)
    assert "model.layers.1.mlp.shared_expert.down_proj" in packed and "model.layers.1.mlp.experts.3.down_proj" in packed


def test_gpt_oss_is_refused_before_any_work(moe, tmp_path):
    model = moe["models"]["gpt_oss"]
    out = tmp_path / "calib"
    p = run_main("calibrate", str(model), "--out", str(out), "--config", "quick", "--device", "cpu", "--scores", "none")
    assert_one_line_error(p, 2, "model.layers.0.mlp.experts.down_proj is a 3-D tensor", "gpt-oss", "nothing was calibrated")
    assert leftovers(out) == []
    calib = make_calibration(moe["models"]["mixtral"], tmp_path / "c")
    p = run_main("pack", str(model), "--calib", str(calib), "--out", str(tmp_path / "ck"), "--ratio", "0", "--device", "cpu")
    assert_one_line_error(p, 2, "3-D tensor", "nothing was packed")
    assert leftovers(tmp_path / "ck") == []


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--scores", "none", "--pipeline", "sequential"], "--pipeline sequential does not run mixture-of-experts models yet"),
        (["--scores", "none", "--moe-calib", "some"], "--moe-calib must be one of all, routed"),
    ],
)
def test_calibrate_refuses_what_moe_does_not_do_yet(moe, tmp_path, extra, needle):
    out = tmp_path / "calib"
    p = run_main("calibrate", str(moe["models"]["qwen3_moe"]), "--out", str(out), "--config", "quick", "--device", "cpu", *extra)
    assert_one_line_error(p, 2, needle)
    assert leftovers(out) == []


def test_grad_scores_cover_every_expert(moe, moe_scored):
    sc = json.loads((moe_scored / "scores.json").read_text())
    rec = json.loads((moe_scored / "calibration.json").read_text())
    assert [g["modules"] for g in sc["groups"]] == rec["groups"]
    blocks = expert_blocks(modelio.tensor_shapes(moe["models"]["qwen3_moe"]))
    by_head = {g["modules"][0]: g for g in sc["groups"]}
    for b in blocks:
        for e in range(b.num_experts):
            for role in ("gate", "down"):
                g = by_head[b.module(e, role)]
                s = {float(k): v for k, v in g["scores"].items()}
                assert g["weight_count"] == (2 if role == "gate" else 1) * b.hidden * b.intermediate
                # an expert's error falls as compensation rises, and full beats plain by far
                assert all(v >= 0 for v in s.values()) and s[1.0] < 0.8 * s[0.0]
