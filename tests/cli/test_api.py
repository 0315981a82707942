"""The Python API: the same steps and bytes as the CLI, typed results, no lasting side effects."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from resserve_export import api
from resserve_export.cli import main
from resserve_export.core.errors import UserError

from tests.fixtures.models import make_llama, varied_texts, write_jsonl


SETTINGS = dict(num_samples=6, seq_len=32, batch_size=2, score_samples=2, device="cpu")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("api")
    return make_llama(root / "model", dtype=torch.bfloat16), write_jsonl(root / "docs.jsonl", varied_texts(8))


def cli(*args: str) -> None:
    try:
        main(list(args))
    except SystemExit as e:
        assert e.code in (0, None), args


def process_state() -> dict:
    import datasets
    import datasets.config
    import huggingface_hub.constants as hub
    from datasets.utils import logging as ds_logging
    from transformers.utils import logging as hf_logging

    cfg = torch._dynamo.config
    return {
        "env": dict(os.environ),
        "threads": torch.get_num_threads(),
        "dynamo": (cfg.recompile_limit, cfg.cache_size_limit, getattr(cfg, "accumulated_recompile_limit", None)),
        "transformers": (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()),
        "datasets": (datasets.config.HF_HUB_OFFLINE, ds_logging.get_verbosity(), datasets.is_progress_bar_enabled()),
        "hub_offline": hub.HF_HUB_OFFLINE,
    }


def test_api_pipeline_equals_the_cli_byte_for_byte(inputs, tmp_path):
    model, texts = inputs
    before = process_state()
    cal = api.calibrate(str(model), tmp_path / "a" / "calib", dataset=str(texts), **SETTINGS)
    assert process_state() == before
    assert cal.path == tmp_path / "a" / "calib" and cal.scores == "grad" and cal.num_samples == 6
    assert cal.num_tokens == cal.record["num_tokens"] > 0 and len(cal.groups) == 2 * 4  # qkv, o, gate/up, down per layer
    plan = api.plan(cal.path, 5.0)
    assert plan.path == cal.path / "plan.json" and plan.chart == cal.path / "plan.png"
    assert 4.0 <= plan.achieved_bits <= 5.0 and set(plan.ratios) == {"+".join(g) for g in cal.groups}
    ck = api.pack(str(model), cal.path, tmp_path / "a" / "ckpt", "nvfp4", plan=plan.path)
    assert ck.groups == len(cal.groups) and ck.bytes_written > 0
    rep = api.verify(ck.out, str(model), calib=cal.path, text=str(texts), samples=2, seq_len=32, device="cpu", out=tmp_path / "a" / "v")
    assert rep.weights_match is True and rep.model_dtype == "bfloat16" and rep.format == "nvfp4"
    assert rep.pooled_nmse["full"] < rep.pooled_nmse["plain"] and set(rep.perplexity) == {"bf16", "plain", "checkpoint", "full"}
    assert process_state() == before

    b = tmp_path / "b"
    cli("calibrate", str(model), "--out", str(b / "calib"), "--dataset", str(texts), "--num-samples", "6", "--seq-len", "32",
        "--batch-size", "2", "--score-samples", "2", "--device", "cpu", "-q")
    cli("plan", "--calib", str(b / "calib"), "--budget", "5.0")
    cli("pack", str(model), "--calib", str(b / "calib"), "--plan", str(b / "calib" / "plan.json"), "--format", "nvfp4", "--out", str(b / "ckpt"))
    assert (b / "calib" / "salience.safetensors").read_bytes() == (cal.path / "salience.safetensors").read_bytes()
    for name in ("scores.json", "calibration.json"):  # equal but for the run's wall time
        mine, theirs = (json.loads((d / name).read_text()) for d in (cal.path, b / "calib"))
        assert mine.pop("wall_time_s") > 0 and theirs.pop("wall_time_s") > 0
        assert mine == theirs, name
    files = sorted(p.name for p in ck.out.iterdir())
    assert files == sorted(p.name for p in (b / "ckpt").iterdir())
    for name in files:
        assert (b / "ckpt" / name).read_bytes() == (ck.out / name).read_bytes(), name


def test_api_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="outside"):
        api.plan(tmp_path, 9.0)
    with pytest.raises(UserError, match="does not exist"):
        api.size(tmp_path / "nope.json")
    before = process_state()
    with pytest.raises(UserError):
        api.calibrate(str(tmp_path / "no-model"), tmp_path / "c", num_samples=1)
    assert process_state() == before
