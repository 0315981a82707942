"""`resserve-export calibrate` through the CLI entry point: one-line errors, exit codes, SmolLM2 end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resserve_export.stages.calibrate import config as calib_config
from resserve_export.stages.calibrate import run as cal
from resserve_export.storage import calibration
from resserve_export.modeling import modelio
from resserve_export.cli import main
from resserve_export.modeling.groups import group_linears, linears_from_shapes

from tests.fixtures.models import make_llama, varied_texts, write_jsonl




def cli(*args: str) -> int:
    with pytest.raises(SystemExit) as e:
        main(["calibrate", *args])
    return e.value.code


def cli_ok(*args: str) -> None:
    """A successful command returns normally (or exits 0)."""
    try:
        main(["calibrate", *args])
    except SystemExit as e:
        assert e.code in (0, None)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("cli") / "model")


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("clitexts") / "docs.jsonl", varied_texts(6))


def base(model: Path, out: Path, texts: Path) -> list[str]:
    return [str(model), "--out", str(out), "--dataset", str(texts), "--num-samples", "4", "--seq-len", "32", "--device", "cpu", "-q"]


def test_missing_model_path(tmp_path, capsys, texts):
    assert cli(*base(tmp_path / "no-such-model", tmp_path / "out", texts)) == 2
    assert "does not exist" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_unknown_dataset(tiny, tmp_path, capsys):
    args = base(tiny, tmp_path / "out", Path("x"))
    args[args.index("--dataset") + 1] = "no_such_dataset_anywhere_xyz"
    assert cli(*args) == 2
    assert "unknown dataset 'no_such_dataset_anywhere_xyz'" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_missing_dataset_file(tiny, tmp_path, capsys):
    assert cli(*base(tiny, tmp_path / "out", tmp_path / "absent.jsonl")) == 2
    assert "does not exist" in one_line_error(capsys)


def test_empty_dataset_after_filtering(tiny, tmp_path, capsys):
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "   ", "\n\n"])
    assert cli(*base(tiny, tmp_path / "out", empty)) == 2
    assert "no non-empty text after filtering" in one_line_error(capsys)


def test_seq_len_zero(tiny, tmp_path, capsys, texts):
    args = base(tiny, tmp_path / "out", texts)
    args[args.index("--seq-len") + 1] = "0"
    assert cli(*args) == 2
    assert "--seq-len must be a positive integer, got 0" in one_line_error(capsys)


def test_unknown_score_precision(tiny, tmp_path, capsys, texts):
    assert cli(*base(tiny, tmp_path / "out", texts), "--scores", "grad", "--score-precision", "fp16") == 2
    assert "--score-precision must be one of auto, fp32, bf16, got 'fp16'" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_score_precision_is_used_and_recorded(tiny, tmp_path, texts, precision):
    out = tmp_path / "out"
    cli_ok(*base(tiny, out, texts), "--dtype", "bfloat16", "--scores", "grad", "--score-samples", "2", "--score-precision", precision)
    rec = json.loads((out / "scores.json").read_text())
    assert rec["precision"] == precision and rec["method"] == "grad"


def test_unknown_preset_lists_names(tiny, tmp_path, capsys, texts):
    assert cli(*base(tiny, tmp_path / "out", texts), "--config", "nope") == 2
    err = one_line_error(capsys)
    assert "unknown calibration config 'nope'" in err and "paper" in err and "quick" in err


def test_in_features_not_multiple_of_32_names_the_layer(tmp_path, capsys, texts):
    odd = make_llama(tmp_path / "odd", intermediate=80)
    capsys.readouterr()
    assert cli(*base(odd, tmp_path / "out", texts)) == 2
    err = one_line_error(capsys)
    assert "model.layers.0.mlp.down_proj" in err and "in_features 80" in err and "multiple of 32" in err


def test_non_finite_activations_name_the_first_layer(tmp_path, capsys, texts):
    # A NaN in layer 1's up_proj weight: its output, hence the input of layer 1's down_proj, is NaN.
    bad = make_llama(tmp_path / "nan", poison="model.layers.1.mlp.up_proj.weight")
    capsys.readouterr()
    assert cli(*base(bad, tmp_path / "out", texts)) == 2
    err = one_line_error(capsys)
    assert "non-finite" in err and "model.layers.1.mlp.down_proj" in err
    assert not (tmp_path / "out").exists()


def test_existing_non_empty_dir_needs_overwrite(tiny, tmp_path, capsys, texts):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli(*base(tiny, out, texts)) == 2
    assert "--overwrite" in one_line_error(capsys)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    cli_ok(*base(tiny, out, texts), "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["calibration.json", "kv_cache.safetensors", "salience.safetensors", "scores.json"]


def test_unknown_device(tiny, tmp_path, capsys, texts):
    args = base(tiny, tmp_path / "out", texts)
    args[args.index("--device") + 1] = "tpu"
    assert cli(*args) == 2
    assert "unknown --device 'tpu'" in one_line_error(capsys)


@pytest.mark.slow
def test_smollm2_quick_end_to_end(tmp_path, capsys):
    # In float32 and without scores: what is asserted (groups, record, statistics' shapes and
    # bounds, the salience spread of layer 0) depends on neither, bf16 GEMMs on a CPU without
    # AVX512-BF16 or AMX (the 2-core CI machine) run this preset ~9x slower (526 s against 61 s),
    # and the scores' candidate graphs compile for minutes on a cold cache. Grad scores of the
    # real model through the CLI: test_installed_wheel_works_outside_the_repository; their
    # figures: test_smollm2_budget_plan_beats_uniform.
    out = tmp_path / "calib"
    cli_ok("default", "--out", str(out), "--config", "quick", "--device", "cpu", "--dtype", "float32", "--scores", "none")
    assert "wrote" in capsys.readouterr().out
    rec = json.loads((out / "calibration.json").read_text())
    stats = calibration.load_stats(out)
    model_dir = modelio.resolve_model(str(modelio.default_model()))
    groups = group_linears(linears_from_shapes(modelio.tensor_shapes(model_dir)))
    assert len(groups) == 30 * 4 and len(stats) == 30 * 7
    assert sorted(rec["groups"]) == sorted(list(g.modules) for g in groups)
    assert rec["groups"][:2] == [[f"model.layers.0.self_attn.{p}_proj" for p in "qkv"], ["model.layers.0.self_attn.o_proj"]]
    assert rec["fingerprint"] == modelio.fingerprint(model_dir)
    assert (rec["num_samples"], rec["seq_len"], rec["batch_size"], rec["seed"]) == (32, 256, 8, 42)
    assert rec["num_tokens"] == 32 * 256  # every play is longer than 256 tokens: no padding
    assert (rec["dtype"], rec["scores"]) == ("float32", "none") and not (out / "scores.json").exists()
    for g in groups:
        head = stats[g.modules[0]]
        assert head["mean_abs"].shape == (g.in_features,) and head["mean_abs"].dtype == torch.float32
        assert torch.isfinite(head["mean_abs"]).all() and (head["mean_abs"] > 0).all()
        assert head["amax"] >= head["mean_abs"].max()
        for m in g.modules[1:]:
            assert torch.equal(stats[m]["mean_abs"], head["mean_abs"]) and torch.equal(stats[m]["amax"], head["amax"])
    # The first layer's q/k/v input is the normalized embedding; SmolLM2's is far from uniform.
    ma = stats["model.layers.0.self_attn.q_proj"]["mean_abs"]
    assert ma.max() / ma.median() > 3


def test_unknown_weight_algo(tiny, tmp_path, capsys, texts):
    assert cli(*base(tiny, tmp_path / "out", texts), "--weight-algo", "spqr") == 2
    assert "unknown --weight-algo 'spqr': choose one of rtn, awq, gptq, awq+gptq" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_awq_tokens_must_be_positive(tiny, tmp_path, capsys, texts):
    assert cli(*base(tiny, tmp_path / "out", texts), "--weight-algo", "awq", "--awq-tokens", "0") == 2
    assert "--awq-tokens must be a positive integer, got 0" in one_line_error(capsys)


def test_weight_algo_awq_through_the_cli(tiny, tmp_path, texts):
    out = tmp_path / "out"
    cli_ok(*base(tiny, out, texts), "--scores", "none", "--weight-algo", "awq", "--awq-tokens", "64")
    rec = json.loads((out / "calibration.json").read_text())
    assert rec["weight_algo"]["name"] == "awq" and rec["config"]["weight_algo"] == "awq" and rec["config"]["awq_tokens"] == 64
    assert (out / "awq.safetensors").is_file()


def test_unknown_pipeline(tiny, tmp_path, capsys, texts):
    assert cli(*base(tiny, tmp_path / "out", texts), "--pipeline", "layers") == 2
    assert "--pipeline must be one of whole, sequential, auto, got 'layers'" in one_line_error(capsys)


def test_sequential_pipeline_through_the_cli(tiny, tmp_path, texts):
    cli_ok(*base(tiny, tmp_path / "seq", texts), "--scores", "none", "--pipeline", "sequential")
    cli_ok(*base(tiny, tmp_path / "whole", texts), "--scores", "none", "--pipeline", "whole")
    assert (tmp_path / "seq" / "salience.safetensors").read_bytes() == (tmp_path / "whole" / "salience.safetensors").read_bytes()
    assert json.loads((tmp_path / "seq" / "calibration.json").read_text())["pipeline"] == "sequential"


@pytest.mark.parametrize("fast, dtype, noted", [(False, "bfloat16", True), (False, "float32", False), (True, "bfloat16", False)])
def test_slow_bf16_cpu_is_noted(tiny, tmp_path, texts, capsys, monkeypatch, fast, dtype, noted):
    """On a CPU without AVX512-BF16 or AMX a bf16 run says once that float32 is faster there."""
    monkeypatch.setattr(calib_config, "fast_bf16", lambda device: fast)
    argv = [a for a in base(tiny, tmp_path / "out", texts) if a != "-q"]
    cli_ok(*argv, "--scores", "none", "--dtype", dtype)
    err = capsys.readouterr().err
    assert err.count("no AVX512-BF16 or AMX") == (1 if noted else 0), err
    if noted:
        assert "--dtype float32 calibrates faster" in err
