"""`resserve-export plan`: output contract, budget, fused groups, errors, determinism (no model)."""

import json
import math
import random
import subprocess
import sys

import pytest

from resserve_export.modeling import modelio

from resserve_export.stages import plan as P
from resserve_export.core import names
from resserve_export.cli import main

KINDS = [
    (("self_attn", ("q_proj", "k_proj", "v_proj")), (576, 192, 192), 576),
    (("self_attn", ("o_proj",)), (576,), 576),
    (("mlp", ("gate_proj", "up_proj")), (1536, 1536), 576),
    (("mlp", ("down_proj",)), (576,), 1536),
]


def make_scores(layers=6, seed=0, ties=False):
    rng = random.Random(seed)
    groups = []
    for l in range(layers):
        for (block, leaves), outs, K in KINDS:
            base = rng.uniform(0.1, 2.0)
            fall = sorted((rng.uniform(0.2, 1.0) for _ in range(4)), reverse=True)
            vals = [base] + [base * f for f in fall]
            if ties:
                vals = [round(v, 1) for v in vals]
            groups.append(
                {
                    "modules": [f"model.layers.{l}.{block}.{m}" for m in leaves],
                    "weight_count": sum(outs) * K,
                    "scores": {names.ratio_key(r): v for r, v in zip((0, 0.125, 0.25, 0.5, 1), vals)},
                }
            )
    return {"method": "kl", "samples": 4, "ratios": [0, 0.125, 0.25, 0.5, 1], "groups": groups}


@pytest.fixture
def calib(tmp_path):
    d = tmp_path / "calib"
    d.mkdir()
    (d / "scores.json").write_text(json.dumps(make_scores()))
    (d / "calibration.json").write_text(json.dumps({"model": "toy", "fingerprint": "f00", "fingerprint_method": modelio.FINGERPRINT_METHOD}))
    return d


def run(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def run_ok(args, capsys):
    main(args)  # success returns normally
    return capsys.readouterr().out


def test_plan_contract_and_budget(calib, capsys):
    out = run_ok(["plan", "--calib", str(calib), "--budget", "5.0"], capsys)
    assert "achieved" in out and "q/k/v" in out
    plan = json.loads((calib / "plan.json").read_text())
    assert (calib / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for key in ("budget", "achieved_bits", "satisfied", "method", "groups", "fingerprint"):
        assert key in plan
    assert plan["budget"] == 5.0 and plan["satisfied"] is True and plan["method"] == "kl"
    assert plan["fingerprint"] == "f00"
    scores = make_scores()
    n = [g["weight_count"] for g in scores["groups"]]
    bits = sum(w * 4 * (1 + g["ratio"]) for w, g in zip(n, plan["groups"])) / sum(n)
    assert math.isclose(plan["achieved_bits"], bits, rel_tol=1e-12)
    assert 4.9 < bits <= 5.0  # the budget is used, never exceeded
    for sg, pg in zip(scores["groups"], plan["groups"]):
        # A fused group is one decision: one entry, one ratio, all members listed.
        assert pg["modules"] == sg["modules"]
        assert pg["score"] == sg["scores"][names.ratio_key(pg["ratio"])]
        assert pg["bits"] == 4 * (1 + pg["ratio"])
    assert math.isclose(plan["objective"], sum(g["score"] for g in plan["groups"]))
    # Uniform 0.25 costs the same bits; the optimum can only be better.
    assert plan["objective"] < sum(g["scores"]["0.25"] for g in scores["groups"])
    ratios = P.module_ratios(P.load_plan(calib / "plan.json", check_weights=_weights_of("f00")))
    assert len(ratios) == sum(len(g["modules"]) for g in scores["groups"])


@pytest.mark.parametrize("budget", [4.0, 4.5, 5.0, 6.25, 8.0])
@pytest.mark.parametrize("solver", ["cbc", "greedy"])
def test_budget_holds(calib, budget, solver):
    scores, cal = P.read_scores(calib)
    plan = P.build_plan(scores, budget, solver=solver, calibration=cal)
    assert plan["achieved_bits"] <= budget
    if budget == 4.0:
        assert {g["ratio"] for g in plan["groups"]} == {0.0}
    if budget == 8.0:
        assert {g["ratio"] for g in plan["groups"]} == {1.0}


def test_ilp_beats_or_ties_greedy(calib):
    scores, _ = P.read_scores(calib)
    for b in (4.3, 5.0, 5.7):
        assert P.build_plan(scores, b)["objective"] <= P.build_plan(scores, b, solver="greedy")["objective"] + 1e-12


def test_ratio_subset(calib, capsys):
    run_ok(["plan", "--calib", str(calib), "--budget", "6", "--ratios", "0,1", "--out", str(calib / "sub" / "p.json")], capsys)
    plan = json.loads((calib / "sub" / "p.json").read_text())
    assert (calib / "sub" / "p.png").exists()
    assert {g["ratio"] for g in plan["groups"]} <= {0.0, 1.0}
    assert plan["ratios"] == [0.0, 1.0]


def test_same_inputs_same_plan(tmp_path, capsys):
    d = tmp_path / "c"
    d.mkdir()
    (d / "scores.json").write_text(json.dumps(make_scores(layers=10, seed=3, ties=True)))
    run_ok(["plan", "--calib", str(d), "--budget", "5.3", "--out", str(tmp_path / "a.json")], capsys)
    run_ok(["plan", "--calib", str(d), "--budget", "5.3", "--out", str(tmp_path / "b.json")], capsys)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--budget", "3.9"], "outside [4, 8]"),
        (["--budget", "8.5"], "outside [4, 8]"),
        (["--budget", "nan"], "outside [4, 8]"),
        (["--budget", "4.5", "--ratios", "0.25,1"], "cannot be met"),
        (["--budget", "5", "--ratios", "0.3"], "no stored score"),
        (["--budget", "5", "--ratios", "x"], "not a number"),
        (["--budget", "5", "--solver", "simplex"], "unknown solver"),
    ],
)
def test_cli_errors(calib, capsys, args, needle):
    code, out, err = run(["plan", "--calib", str(calib), *args], capsys)
    assert code == 2
    assert needle in err and err.startswith("error: ") and err.count("\n") == 1
    assert "Traceback" not in err
    assert not (calib / "plan.json").exists()


def test_no_scores_is_an_error(tmp_path, capsys):
    d = tmp_path / "c"
    d.mkdir()
    (d / "calibration.json").write_text("{}")
    code, _, err = run(["plan", "--calib", str(d), "--budget", "5"], capsys)
    assert code == 2 and "--scores" in err and err.count("\n") == 1
    code, _, err = run(["plan", "--calib", str(tmp_path / "missing"), "--budget", "5"], capsys)
    assert code == 2 and "does not exist" in err
    (d / "scores.json").write_text("{not json")
    code, _, err = run(["plan", "--calib", str(d), "--budget", "5"], capsys)
    assert code == 2 and "not valid JSON" in err


def _weights_of(fingerprint: str):
    """What pack passes as `check_weights`: the plan must come from weights with `fingerprint`."""
    return lambda record: modelio.check_fingerprint(record, fingerprint, "plan")


def test_load_plan_rejects_other_model(calib, capsys):
    run_ok(["plan", "--calib", str(calib), "--budget", "5"], capsys)
    with pytest.raises(Exception, match="other weights"):
        P.load_plan(calib / "plan.json", check_weights=_weights_of("other"))
    with pytest.raises(Exception, match="made for another model"):
        P.load_plan(calib / "plan.json", modules=["model.layers.0.self_attn.q_proj"])


def test_console_script_exit_code(calib):
    # The installed entry point: one line on stderr, exit 2, no traceback.
    r = subprocess.run(
        [sys.executable, "-m", "resserve_export.cli", "plan", "--calib", str(calib), "--budget", "9"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: budget 9") and "Traceback" not in r.stderr
