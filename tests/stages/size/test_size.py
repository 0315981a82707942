"""`size` from config.json alone: equal to what `pack` writes, and the Qwen3-8B figures of docs/formats.md ("Checkpoint size")."""

from __future__ import annotations

import json

import pytest

from resserve_export.cli import main
from resserve_export.core.errors import UserError
from resserve_export.stages.layout import build_layout, model_groups
from resserve_export.stages.pack.run import pack
from resserve_export.stages.size import estimate, shapes_from_config
from resserve_export.storage.checkpoint import Checkpoint

from tests.fixtures.checkpoints import written_classes
from tests.fixtures.tiny import group_list, make_calibration, make_model, plan_fields

# Qwen3-8B's public architecture (config.json numbers).
QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}
TOKENIZER = 16_000_000  # "about 16 MB of tokenizer files"

# docs/formats.md, "Checkpoint size", GiB.
REFERENCE_FIGURES = {
    ("nvfp4", 0.0): 5.973,
    ("nvfp4", 0.125): 6.431,
    ("nvfp4", 0.25): 6.888,
    ("mxfp4", 0.0): 5.770,
    ("mxfp4", 0.125): 6.204,
    ("mxfp4", 0.25): 6.635,
}
# Our exact totals for that config (bytes), pinned: any change in layout shows up here.
PINNED_TOTALS = {
    ("nvfp4", 0.0): 6413164423,
    ("nvfp4", 0.125): 6901867567,
    ("nvfp4", 0.25): 7390242079,
    ("mxfp4", 0.0): 6196008507,
    ("mxfp4", 0.125): 6657578475,
    ("mxfp4", 0.25): 7118821043,
}


@pytest.mark.parametrize("fmt,ratio", list(REFERENCE_FIGURES))
def test_qwen3_8b_within_half_percent_of_spec(fmt, ratio):
    rep = estimate(QWEN3_8B, fmt, ratio=ratio, other_bytes=TOKENIZER)
    gib = rep.total / 2**30
    assert abs(gib - REFERENCE_FIGURES[(fmt, ratio)]) / REFERENCE_FIGURES[(fmt, ratio)] < 0.005, gib
    assert rep.total == PINNED_TOTALS[(fmt, ratio)]


def test_qwen3_8b_classes_follow_spec_formula():
    n = 36 * (4096 * (4096 + 1024 + 1024) + 4096 * 4096 + 3 * 12288 * 4096)  # weights per linear class
    rep = estimate(QWEN3_8B, "nvfp4", ratio=0.125, other_bytes=0).classes
    assert rep["quantized linears"] == n // 2 + n // 16 + 8 * 7 * 36
    # K_E: K=4096 -> 512, K=12288 -> 1536 (both already multiples of 64): ext = n/8 weights
    assert rep["extension"] == (n // 8) // 2 + (n // 8) // 16
    assert rep["masks"] == 36 * (6 * 4096 // 8 + 12288 // 8)
    assert rep["embeddings"] == 2 * 151936 * 4096 * 2
    mx = estimate(QWEN3_8B, "mxfp4", ratio=0.0, other_bytes=0).classes
    assert mx["quantized linears"] == n // 2 + n // 32 and mx["extension"] == mx["masks"] == 0


def test_mxfp4_padding_rule_and_tied_embeddings():
    cfg = {**QWEN3_8B, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 1, "tie_word_embeddings": True}
    shapes = shapes_from_config(cfg)
    assert "lm_head.weight" not in shapes
    groups = model_groups(shapes)
    ratios = {g.name: 0.125 for g in groups}
    by = {fmt: {r["members"][0]: r["K_E"] for r in build_layout(shapes, groups, ratios, fmt, True).groups} for fmt in ("nvfp4", "mxfp4")}
    q = "model.layers.0.self_attn.q_proj"
    assert (by["nvfp4"][q], by["mxfp4"][q]) == (320, 384)  # docs/formats.md, "The extended weight (K-Ext)": 2880 kept for NVFP4, 2944 for MXFP4
    tied = estimate(cfg, "nvfp4", ratio=0.0).classes["embeddings"]
    untied = estimate({**cfg, "tie_word_embeddings": False}, "nvfp4", ratio=0.0).classes["embeddings"]
    assert untied == 2 * tied == 2 * 151936 * 2560 * 2


@pytest.mark.parametrize(
    "fmt,ratio,tied,shard",
    [("nvfp4", 0.25, False, "5GB"), ("mxfp4", 0.125, True, "5GB"), ("nvfp4", 1.0, False, "30KB"), ("mxfp4", 0.5, False, "20KB")],
)
def test_size_equals_what_pack_writes(tmp_path, fmt, ratio, tied, shard):
    model = make_model(tmp_path / "m", tied=tied)
    calib = make_calibration(model, tmp_path / "c")
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=ratio, max_shard_size=shard, progress=False).out
    cfg = json.loads((model / "config.json").read_text())
    rep = estimate(cfg, fmt, ratio=ratio, max_shard_size=shard)
    got = written_classes(out)
    assert {k: rep.classes[k] for k in got} == got
    assert got["quantized linears"] > 0 and (got["extension"] > 0) == (ratio not in (0, 1))


def test_size_with_plan_equals_pack(tmp_path):
    model = make_model(tmp_path / "m")
    calib = make_calibration(model, tmp_path / "c")
    ratios = [0.0, 0.125, 0.25, 0.5, 1.0]
    plan = {"budget": 5.0, **plan_fields(model), "groups": [{"modules": list(g.modules), "ratio": ratios[i % 5]} for i, g in enumerate(group_list(model))]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = pack(model, calib, tmp_path / "ck", "nvfp4", plan=tmp_path / "plan.json", progress=False).out
    rep = estimate(json.loads((model / "config.json").read_text()), "nvfp4", plan=tmp_path / "plan.json")
    got = written_classes(out)
    assert {k: rep.classes[k] for k in got} == got
    modes = [g["mode"] for g in Checkpoint(out).groups]
    assert set(modes) == {"plain", "k_ext", "full"}


def test_size_cli(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN3_8B))
    main(["size", str(cfg), "--format", "nvfp4", "--ratio", "0.25", "--tokenizer-bytes", str(TOKENIZER), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == PINNED_TOTALS[("nvfp4", 0.25)]
    main(["size", str(cfg), "--format", "mxfp4", "--ratio", "0.125", "--tokenizer-bytes", str(TOKENIZER)])
    text = capsys.readouterr().out
    assert "6.200" in text and "extension" in text and "masks" in text
    with pytest.raises(SystemExit) as e:
        main(["size", str(cfg), "--format", "nvfp4", "--ratio", "0.3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ratio 0.3") and err.count("\n") == 1


def test_size_refuses_unknown_architectures():
    with pytest.raises(UserError, match="size knows the experts of qwen3_moe, mixtral, deepseek_v3 configs"):
        estimate({**QWEN3_8B, "num_experts": 8}, "nvfp4", ratio=0.0)
    with pytest.raises(UserError, match="tensor layout"):
        estimate({**QWEN3_8B, "model_type": "gpt2"}, "nvfp4", ratio=0.0)
