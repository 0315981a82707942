"""`verify` checks the checkpoint against a fresh quantization of --model before measuring.

The reference is recomputed from the model alone (α from its weights by the fused-group rule,
codes, block scales, the K-Ext extension, and with --calib the masks and input scales), so a
checkpoint that is self-consistent but not packed from this model stops with exit code 3 and one
line on stderr, before anything is written. The model is loaded in the dtype it was packed from,
so fp16 and fp32 sources verify without a false mismatch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from resserve_export.algorithms.kext import extend_weight
from resserve_export.core.errors import CheckpointMismatch, UserError
from resserve_export.formats.nvfp4 import global_scale, group_global_scale
from resserve_export.formats.ops import quantize
from resserve_export.modeling import modelio
from resserve_export.stages.verify import checks
from resserve_export.stages.verify import run as verify
from resserve_export.storage.checkpoint import Checkpoint
from resserve_export.formats.nvfp4 import abs_max
from resserve_export.stages.pack.run import pack

from tests.fixtures.console import run_main
from tests.fixtures.models import make_llama, varied_texts, write_jsonl
from tests.fixtures.tiny import make_calibration


Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.down_proj"


def build(root: Path, dtype: torch.dtype) -> tuple[Path, Path, Path]:
    """(model, calibration, checkpoint packed from them: NVFP4, ρ = 0.25)."""
    model = make_llama(root / "model", dtype=dtype)
    calib = make_calibration(model, root / "calib")
    ck = root / "ck"
    pack(str(model), calib, ck, "nvfp4", ratio=0.25, device="cpu", progress=False)
    return model, calib, ck


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> tuple[Path, Path, Path]:
    return build(tmp_path_factory.mktemp("bf16"), torch.bfloat16)


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("text") / "docs.jsonl", varied_texts(4))


def verify_args(ck: Path, model: Path, text: Path, out: Path, *extra: str) -> list[str]:
    return ["verify", str(ck), "--model", str(model), "--text", str(text), "--samples", "2", "--seq-len", "32", "--device", "cpu",
            "--out", str(out), *extra]


def run_verify(ck: Path, model: Path, text: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """The real console entry point in a fresh process (the exit code of the module's `main` as
    the interpreter ends with it)."""
    cmd = [sys.executable, "-m", "resserve_export.cli", *verify_args(ck, model, text, out, *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def verify_main(ck: Path, model: Path, text: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """The same command through `cli.main` in this process: the same exit code and output, without
    a new interpreter (~10 s of imports and model loading on the CI machine) for each mismatch."""
    return run_main(*verify_args(ck, model, text, out, *extra))


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def edit_shards(src: Path, dst: Path, prefix: str, edit) -> Path:
    """A copy of checkpoint `src` at `dst` with `edit(tensors)` applied to its `prefix` shards."""
    shutil.copytree(src, dst)
    for f in sorted(dst.glob(f"{prefix}-*.safetensors")):
        tensors = load_file(str(f))
        edit(tensors)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


def model_weight(model: Path, name: str) -> torch.Tensor:
    return load_file(str(next(model.glob("*.safetensors"))))[name]


# ----------------------------------------------------------------------------- exit codes


def test_matching_checkpoint_exits_0(bf16, text, tmp_path):
    """Through `python -m resserve_export.cli` in a fresh process: the module's entry point and
    its exit code; the mismatches below go through the same `cli.main` in this process."""
    model, calib, ck = bf16
    out = tmp_path / "v"
    r = run_verify(ck, model, text, out, "--calib", str(calib))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((out / "verify.json").read_text())
    assert rep["weights_match_reference"] is True
    assert rep["model_dtype"] == "bfloat16"


def test_rescaled_weight_scale_2_exits_3(bf16, text, tmp_path):
    """q_proj re-quantized consistently with twice its α (codes, block scales and extension all
    follow the stored α): only an α recomputed from the model tells it apart."""
    model, calib, ck = bf16
    w = model_weight(model, f"{Q}.weight")
    stored = Checkpoint(ck).read(Q)
    alpha = stored.base.global_scale * 2
    q = quantize(w, "nvfp4", alpha=alpha)
    ext = extend_weight(w, stored.mask, 0.25, "nvfp4", alpha=alpha)

    def edit_model(t):
        t[f"{Q}.weight"], t[f"{Q}.weight_scale"], t[f"{Q}.weight_scale_2"] = q.codes, q.scales, alpha.reshape(())

    def edit_side(t):
        t[f"{Q}.resserve_weight"], t[f"{Q}.resserve_weight_scale"] = ext.codes, ext.scales

    edit_shards(edit_shards(ck, tmp_path / "ck1", "model", edit_model), tmp_path / "ck2", "resserve", edit_side)
    out = tmp_path / "v"
    r = verify_main(tmp_path / "ck2", model, text, out)
    assert r.returncode == 3, r.stderr[-2000:]
    line = one_line(r)
    assert f"1 of 14 stored linears differ from a fresh quantization of {model} (first: {Q}: weight_scale_2)" in line
    assert "pass the --model it was packed from" in line and "SPEC" not in line
    assert not out.exists()


def test_tampered_extension_byte_exits_3(bf16, text, tmp_path):
    model, calib, ck = bf16

    def edit(t):
        t[f"{DOWN}.resserve_weight"].view(-1)[7] ^= 0x11

    bad = edit_shards(ck, tmp_path / "ck", "resserve", edit)
    out = tmp_path / "v"
    r = verify_main(bad, model, text, out, "--calib", str(calib))
    assert r.returncode == 3, r.stderr[-2000:]
    assert f"(first: {DOWN}: resserve_weight)" in one_line(r)
    assert not out.exists()


def test_same_shaped_other_model_exits_nonzero(bf16, text, tmp_path):
    model, calib, ck = bf16
    other = shutil.copytree(model, tmp_path / "other")
    f = next(other.glob("*.safetensors"))
    tensors = load_file(str(f))
    tensors[f"{DOWN}.weight"] = tensors[f"{DOWN}.weight"] * 1.5
    save_file(tensors, str(f), metadata={"format": "pt"})
    out = tmp_path / "v"
    r = verify_main(ck, other, text, out)
    assert r.returncode in (2, 3), r.stderr[-2000:]  # the fingerprint or the weight check
    assert "packed from" in one_line(r)
    assert not out.exists()


# ----------------------------------------------------------------------------- what is checked


def test_calibration_derived_tensors_are_checked_with_calib(bf16, tmp_path):
    """A consistent checkpoint whose mask (and extension) or input scale is not the
    calibration's passes without --calib and fails with it, naming the calibration."""
    model, calib, ck = bf16
    stored = Checkpoint(ck).read(DOWN)
    mask = torch.full_like(stored.mask, 0b11)  # valid (2 of 8 per group) but not the top-k
    assert not torch.equal(mask, stored.mask)
    ext = extend_weight(model_weight(model, f"{DOWN}.weight"), mask, 0.25, "nvfp4", alpha=stored.base.global_scale)

    def edit_side(t):
        t[f"{DOWN}.resserve_mask"], t[f"{DOWN}.resserve_weight"], t[f"{DOWN}.resserve_weight_scale"] = mask, ext.codes, ext.scales

    def edit_scale(t):
        t[f"{DOWN}.input_scale"] = t[f"{DOWN}.input_scale"] * 2

    weights = checks.linear_weights(modelio.load_model(model), Checkpoint(ck))
    for i, (prefix, edit, name) in enumerate([("resserve", edit_side, "resserve_mask"), ("model", edit_scale, "input_scale")]):
        bad = edit_shards(ck, tmp_path / f"ck{i}", prefix, edit)
        assert checks.weight_mismatches(Checkpoint(bad), weights) == []  # the weights alone agree
        with pytest.raises(CheckpointMismatch, match=rf"\(first: {DOWN}: {name}\) with the given --calib.*pass the --calib it was packed with"):
            verify.verify(bad, str(model), calib=calib, out=tmp_path / "v", device="cpu")
        assert not (tmp_path / "v").exists()


def test_weight_mismatches_lists_every_differing_linear(bf16):
    model, calib, ck_dir = bf16
    ck = Checkpoint(ck_dir)
    weights = checks.linear_weights(modelio.load_model(model), ck)
    assert checks.weight_mismatches(ck, weights) == []
    weights = {m: w * 1.5 if ".0." in m else w for m, w in weights.items()}
    bad = checks.weight_mismatches(ck, weights)
    assert [m for m, _ in bad] == [m for m in ck.modules if ".0." in m]
    assert {n for _, n in bad} == {"weight_scale_2"}


def test_group_global_scale_is_the_max_over_members(gen):
    ws = [torch.randn(32, 64, generator=gen).to(torch.bfloat16) * s for s in (0.5, -3.0, 1.0)]
    assert torch.equal(group_global_scale(ws), global_scale(max(abs_max(w).float() for w in ws)))
    assert group_global_scale(iter(ws)).dtype == torch.float32 and group_global_scale(ws).shape == ()


# ----------------------------------------------------------------------------- source dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_sources_verify_in_their_dtype(dtype, tmp_path, text):
    model, calib, ck = build(tmp_path, dtype)
    name = str(dtype).removeprefix("torch.")
    assert Checkpoint(ck).resserve["provenance"]["source_dtype"] == name
    rep = verify.verify(ck, str(model), text=str(text), samples=2, seq_len=32, calib=calib, device="cpu")
    assert rep["weights_match_reference"] is True
    assert rep["model_dtype"] == name
    # The stored extension is the sweep's ρ = 0.25 (same mask, same weights): both are measured
    # against the same source-dtype reference, so the two NMSEs agree exactly.
    pooled = rep["nmse"]["pooled"]
    assert pooled["checkpoint"] == pooled["ratio_0.25"]

    # A checkpoint that predates the recorded dtype: read from the model's safetensors headers.
    cfg_path = ck / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["quantization_config"]["resserve"]["provenance"]["source_dtype"]
    cfg_path.write_text(json.dumps(cfg))
    rep = verify.verify(ck, str(model), text=str(text), samples=1, seq_len=16, calib=calib, device="cpu")
    assert rep["model_dtype"] == name and rep["weights_match_reference"] is True


def test_pack_refuses_mixed_source_dtypes(tmp_path):
    model = make_llama(tmp_path / "model", dtype=torch.float32)
    f = next(model.glob("*.safetensors"))
    tensors = load_file(str(f))
    tensors[f"{DOWN}.weight"] = tensors[f"{DOWN}.weight"].to(torch.bfloat16)
    save_file(tensors, str(f), metadata={"format": "pt"})
    calib = make_calibration(model, tmp_path / "calib")
    with pytest.raises(UserError, match=r"mixed weight dtypes \(BF16, F32\)") as e:
        pack(str(model), calib, tmp_path / "ck", "nvfp4", ratio=0.25, device="cpu", progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "ck").exists()
