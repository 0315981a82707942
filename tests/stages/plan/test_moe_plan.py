"""`plan` on mixture-of-experts calibrations: a ratio shared across a layer's experts or not,
token-weighted costs, and what to do without scores."""

from __future__ import annotations

import pytest
import torch

from resserve_export.core.errors import UserError
from resserve_export.formats import nvfp4
from resserve_export.stages.pack.run import pack
from resserve_export.storage.checkpoint import read_checkpoint

from tests.fixtures.console import assert_one_line_error, run_main
from tests.fixtures.moe import calibrated
from tests.fixtures.tensors import bits

# The session's MoE models and their cached calibrations (tests.fixtures.moe) are built once:
# under pytest-xdist (--dist loadgroup) every MoE test runs on one worker.
pytestmark = pytest.mark.xdist_group("moe")



def test_plan_without_scores_says_what_to_do(moe, tmp_path):
    p = run_main("plan", "--calib", str(calibrated(moe, "mixtral")), "--budget", "5.0", "--out", str(tmp_path / "plan.json"))
    assert_one_line_error(p, 2, "no sensitivity scores", "--scores grad")


def test_plan_shares_a_ratio_across_a_layers_experts_or_not(moe, moe_scored, tmp_path):
    from resserve_export import api
    from resserve_export.modeling.experts import expert_parts

    shared = api.plan(moe_scored, 5.0, out=tmp_path / "shared.json", chart=False).data
    per = api.plan(moe_scored, 5.0, out=tmp_path / "per.json", chart=False, moe_ratio="per-expert").data
    assert shared["moe"]["ratio"] == "shared" and per["moe"]["ratio"] == "per-expert"
    # 2 layers x (gate/up, down) shared decisions + 2 x (q/k/v, o) dense ones
    assert shared["moe"]["decision_units"] == 8 and per["moe"]["decision_units"] == 4 + 2 * 2 * 8
    ratios = {}
    for g in shared["groups"]:
        parts = expert_parts(g["modules"][0])
        if parts:
            ratios.setdefault((parts[0], parts[2]), set()).add(g["ratio"])
    assert len(ratios) == 4 and all(len(v) == 1 for v in ratios.values())
    # per-expert choices relax the shared ones: never a worse objective, both within the budget
    assert per["objective"] <= shared["objective"] + 1e-12
    assert shared["achieved_bits"] <= 5.0 and per["achieved_bits"] <= 5.0
    # the plan packs
    ck = pack(moe["models"]["qwen3_moe"], moe_scored, tmp_path / "ck", "nvfp4", plan=tmp_path / "per.json", progress=False).out
    got = {m: p.ratio for m, p in read_checkpoint(ck).items()}
    assert got == {m: g["ratio"] for g in per["groups"] for m in g["modules"]}


def test_token_weighted_costs():
    """--moe-cost tokens weights each expert's weights by E·tokens_e / Σ tokens."""
    from resserve_export.stages.plan import decision_units

    def grp(m, n, s):
        return {"modules": [m], "weight_count": n, "scores": {"0": s, "1": s / 2}}

    groups = [grp(f"model.layers.0.mlp.experts.{e}.down_proj", 100, 1.0 + e) for e in range(4)] + [grp("model.layers.0.self_attn.o_proj", 50, 3.0)]
    cal_rec = {"moe": {"blocks": {"model.layers.0.mlp.experts": {"routed_tokens": [10, 30, 0, 40]}}}}
    units, unit_of = decision_units(groups, "per-expert", "tokens", cal_rec)
    assert [u["weight_count"] for u in units] == [50, 150, 0, 200, 50] and unit_of == [0, 1, 2, 3, 4]
    units, unit_of = decision_units(groups, "shared", "bits", cal_rec)
    assert [u["weight_count"] for u in units] == [400, 50] and unit_of == [0, 0, 0, 0, 1]
    assert units[0]["scores"] == {"0": 10.0, "1": 5.0}
    with pytest.raises(UserError, match="routed-token counts"):
        decision_units(groups, "shared", "tokens", {})
    with pytest.raises(UserError, match="--moe-ratio must be one of"):
        decision_units(groups, "each", "bits", cal_rec)
