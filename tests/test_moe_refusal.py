"""Mixture-of-experts models are refused up front, whatever the expert layout: never a partial
quantization (attention only) with exit 0, and never after hours of calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.tiny import make_calibration, make_model
from safetensors import safe_open

from resserve_export import modelio
from resserve_export.layout import expert_tensors

from test_exit_codes import assert_one_line_error, leftovers, run

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def _save(model, path: Path) -> Path:
    model.to(torch.bfloat16).save_pretrained(path)
    # Calibrate tokenizes text: any tokenizer will do, it never gets that far.
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}))
    return path


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    qwen = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16))
    mixtral = MixtralForCausalLM(MixtralConfig(**TINY, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2))
    return {"qwen3_moe": _save(qwen, root / "qwen3_moe"), "mixtral": _save(mixtral, root / "mixtral")}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_checkpoints_hold_expert_tensors(moe_models, arch):
    names = []
    for f in modelio.weight_files(moe_models[arch]):
        with safe_open(str(f), framework="pt") as h:
            names += list(h.keys())
    assert any(".experts." in n for n in names)
    assert expert_tensors(modelio.tensor_shapes(moe_models[arch]))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_calibrate_refuses_moe_before_any_work(moe_models, arch, tmp_path):
    out = tmp_path / "calib"
    p = run("calibrate", str(moe_models[arch]), "--out", str(out), "--config", "quick", "--device", "cpu", "--scores", "none")
    err = assert_one_line_error(p, 2, "mixture-of-experts models are not supported yet", ".experts.", "nothing was calibrated")
    assert "model.layers.0." in err and ".experts.0." in err
    assert leftovers(out) == []


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_pack_refuses_moe(moe_models, arch, tmp_path):
    calib = make_calibration(make_model(tmp_path / "dense"), tmp_path / "c")
    out = tmp_path / "ck"
    p = run("pack", str(moe_models[arch]), "--calib", str(calib), "--out", str(out), "--ratio", "0", "--device", "cpu")
    assert_one_line_error(p, 2, "mixture-of-experts models are not supported yet", "nothing was packed")
    assert leftovers(out) == []


def test_fused_three_dimensional_expert_parameters_count_as_experts():
    shapes = {
        "model.layers.0.mlp.experts.gate_up_proj": ("BF16", (4, 64, 256)),
        "model.layers.0.mlp.experts.gate_up_proj_bias": ("BF16", (4, 256)),
        "model.layers.0.mlp.router.weight": ("BF16", (4, 64)),
        "model.layers.0.self_attn.q_proj.weight": ("BF16", (64, 64)),
        "model.layers.1.block.w_in": ("BF16", (2, 64, 64)),
    }
    assert expert_tensors(shapes) == [
        "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.1.block.w_in"
    ]
