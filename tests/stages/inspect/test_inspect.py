"""`inspect`: format, per-layer ratio/mode, bytes and extension share of a packed checkpoint."""

from __future__ import annotations

import json

import pytest

from resserve_export.cli import main
from resserve_export.stages.inspect import inspect_checkpoint
from resserve_export.stages.pack.run import pack

from tests.fixtures.tiny import group_list, make_calibration, make_model, plan_fields


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("insp")
    model = make_model(root / "m")
    calib = make_calibration(model, root / "c")
    ratios = [0.0, 0.125, 0.25, 0.5, 1.0]
    groups = group_list(model)
    plan = {"budget": 5.0, "method": "kl", **plan_fields(model, "mxfp4", "floor"), "groups": [{"modules": list(g.modules), "ratio": ratios[i % 5]} for i, g in enumerate(groups)]}
    (root / "plan.json").write_text(json.dumps(plan))
    out = pack(model, calib, root / "ck", "mxfp4", plan=root / "plan.json", mx_scale="floor", progress=False).out
    return out, plan


def test_inspect_reports_plan_and_bytes(packed):
    out, plan = packed
    info = inspect_checkpoint(out)
    assert info["format"] == "mxfp4" and info["quant_method"] == "compressed-tensors" and info["mx_scale_rounding"] == "floor"
    want = {tuple(g["modules"]): g["ratio"] for g in plan["groups"]}
    got = {tuple(r["members"]): r["ratio"] for r in info["groups"]}
    assert got == want
    for r in info["groups"]:
        mode = {0.0: "plain", 1.0: "full"}.get(r["ratio"], "k_ext")
        assert r["mode"] == mode
        K, n = r["K"], len(r["members"])
        if mode == "plain":
            assert r["extension_bytes"] == 0
        elif mode == "full":
            assert r["extension_bytes"] == n * K // 8  # masks only
        else:
            assert r["extension_bytes"] > n * K // 8
    st = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    data = info["bytes"]["quantized_linears"] + info["bytes"]["unquantized"] + info["bytes"]["sidecar"]
    assert 0 < st - data < 20000  # the rest is safetensors headers
    side = sum(r["extension_bytes"] for r in info["groups"])
    assert side == info["bytes"]["sidecar"]
    assert info["extension_share"] == pytest.approx(side / data)
    assert info["provenance"]["plan"]["budget"] == 5.0 and info["provenance"]["plan"]["method"] == "kl"


def test_inspect_cli(packed, capsys):
    out, _ = packed
    main(["inspect", str(out)])
    # The console wraps the summary line at its width (80 columns without a terminal), and the
    # line starts with the checkpoint's path, whose length depends on the temp dir: compare words.
    text = " ".join(capsys.readouterr().out.split())
    for word in ("MXFP4", "k_ext", "full", "plain", "extension share"):
        assert word in text, text
    main(["inspect", str(out), "--json"])
    assert json.loads(capsys.readouterr().out)["format"] == "mxfp4"


def test_inspect_bad_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1
