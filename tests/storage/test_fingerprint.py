"""The weight fingerprint covers tensor contents: calibrations and plans of other weights are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from resserve_export.core.errors import UserError
from resserve_export.modeling import modelio
from resserve_export.stages.pack.run import pack

from tests.fixtures.console import run_main
from tests.fixtures.tiny import make_calibration, make_model, make_scores


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("fp") / "model")


def perturbed(src: Path, dst: Path, tensor: str, scale: float = 1.5) -> Path:
    """A same-shaped copy of `src` with one tensor changed (a fine-tune, another model of the family)."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    t = load_file(str(f))
    t[tensor] = (t[tensor].float() * scale).to(t[tensor].dtype)
    save_file(t, str(f), metadata={"format": "pt"})
    return dst


def test_every_tensor_changes_the_fingerprint(model, tmp_path):
    """Flip one byte of each tensor in place (same size, same shapes): the fingerprint changes every time."""
    d = tmp_path / "m"
    shutil.copytree(model, d)
    f = d / "model.safetensors"
    base = modelio.fingerprint(d)
    assert modelio.fingerprint(d) == base  # deterministic (and served from the cache the second time)
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    assert len(header) > 10
    seen = {base}
    for name, e in sorted(header.items()):
        start, end = e["data_offsets"]
        pos = 8 + n + (start + end) // 2  # one byte in the middle of the tensor
        changed = bytearray(raw)
        changed[pos] ^= 0x01
        f.write_bytes(bytes(changed))
        fp = modelio.fingerprint(d)
        assert fp not in seen, name
        seen.add(fp)
    f.write_bytes(raw)
    assert modelio.fingerprint(d) == base


def test_fingerprint_cache_is_keyed_by_file_identity(model, tmp_path, monkeypatch):
    monkeypatch.setenv("RESSERVE_CACHE", str(tmp_path / "cache"))
    fp = modelio.fingerprint(model)
    cache = json.loads((tmp_path / "cache" / "fingerprints.json").read_text())
    (key,) = [k for k in cache if k.startswith(str((model / "model.safetensors").resolve()))]
    assert len(cache[key]) == len(modelio.tensor_shapes(model))
    # A poisoned cache entry for the same identity is what it returns: the key must change with the file.
    cache[key] = {k: [v[0], v[1], "0" * 64] for k, v in cache[key].items()}
    (tmp_path / "cache" / "fingerprints.json").write_text(json.dumps(cache))
    assert modelio.fingerprint(model) != fp
    (tmp_path / "cache" / "fingerprints.json").write_text("not json")
    assert modelio.fingerprint(model) == fp  # a broken cache only costs time


def test_pack_refuses_a_calibration_of_other_weights(model, tmp_path):
    calib = make_calibration(model, tmp_path / "calib")
    other = perturbed(model, tmp_path / "finetune", "model.layers.1.mlp.down_proj.weight")
    assert modelio.tensor_shapes(other) == modelio.tensor_shapes(model)
    assert modelio.fingerprint(other) != modelio.fingerprint(model)
    out = tmp_path / "ck"
    p = run_main("pack", str(other), "--calib", str(calib), "--ratio", "0.25", "--out", str(out))
    err = p.stderr.strip()
    assert p.returncode == 2 and "\n" not in err and "other weights" in err and "--allow-other-weights" in err, p.stderr
    assert not out.exists()
    p = run_main("pack", str(other), "--calib", str(calib), "--ratio", "0.25", "--out", str(out), "--allow-other-weights")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["resserve"]["provenance"]["model_fingerprint"] == modelio.fingerprint(other)


def test_pack_hashes_an_uncached_model_while_it_packs(model, tmp_path, monkeypatch):
    """With no cached digests, pack hashes the weights on a background thread while it quantizes
    and checks the calibration and plan before the rename: the same checkpoint as with the
    fingerprint known up front, and a calibration or plan of other weights refused in one line
    with nothing left behind."""
    calib = make_calibration(model, tmp_path / "calib")
    known = pack(model, calib, tmp_path / "known", "nvfp4", ratio=0.25, progress=False).out
    other = perturbed(model, tmp_path / "finetune", "model.layers.1.mlp.down_proj.weight")
    for i, (src, expect_ok) in enumerate([(model, True), (other, False)]):
        monkeypatch.setenv("RESSERVE_CACHE", str(tmp_path / f"cold{i}"))
        assert modelio.cached_fingerprint(src) is None
        out = tmp_path / f"ck{i}"
        if expect_ok:
            pack(src, calib, out, "nvfp4", ratio=0.25, progress=False)
            assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in known.iterdir())
            for f in known.iterdir():
                assert (out / f.name).read_bytes() == f.read_bytes(), f.name
            assert modelio.cached_fingerprint(src) == modelio.fingerprint(model)  # the background job filled the cache
        else:
            with pytest.raises(UserError, match="calibration in .* other weights"):
                pack(src, calib, out, "nvfp4", ratio=0.25, progress=False)
            assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}")]
    # A plan of other weights, the calibration of these: refused before the rename as well.
    plan = tmp_path / "plan.json"
    make_scores(model, calib)
    assert run_main("plan", "--calib", str(calib), "--budget", "5", "--out", str(plan)).returncode == 0
    plan.write_text(json.dumps({**json.loads(plan.read_text()), "fingerprint": "e" * 64}))
    monkeypatch.setenv("RESSERVE_CACHE", str(tmp_path / "cold-plan"))
    with pytest.raises(UserError, match="plan .* other weights"):
        pack(model, calib, tmp_path / "ck-plan", "nvfp4", plan=plan, progress=False)
    assert not (tmp_path / "ck-plan").exists()


def test_calibration_of_an_older_version_is_refused(model, tmp_path):
    calib = make_calibration(model, tmp_path / "calib")
    meta = json.loads((calib / "calibration.json").read_text())
    del meta["fingerprint_method"]
    (calib / "calibration.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="older resserve-export"):
        pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.0, progress=False)
    assert not (tmp_path / "ck").exists()


def test_plan_refuses_scores_of_other_weights(model, tmp_path):
    calib = make_calibration(model, tmp_path / "calib")
    make_scores(model, calib, fingerprint="e" * 64)
    p = run_main("plan", "--calib", str(calib), "--budget", "5")
    err = p.stderr.strip()
    assert p.returncode == 2 and "\n" not in err and "other weights" in err, p.stderr
    assert not (calib / "plan.json").exists()
    p = run_main("plan", "--calib", str(calib), "--budget", "5", "--allow-other-weights")
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize(
    "scored, packed, needle",
    [
        (("nvfp4", "ceil"), ("mxfp4", "ceil"), "nvfp4 scores but --format is mxfp4"),
        (("mxfp4", "ceil"), ("nvfp4", "ceil"), "mxfp4 scores but --format is nvfp4"),
        (("mxfp4", "floor"), ("mxfp4", "ceil"), "scale rounding floor but --mx-scale is ceil"),
    ],
)
def test_pack_refuses_a_plan_of_another_format(model, tmp_path, scored, packed, needle):
    calib = make_calibration(model, tmp_path / "calib")
    make_scores(model, calib, fmt=scored[0], rounding=scored[1])
    p = run_main("plan", "--calib", str(calib), "--budget", "5")
    assert p.returncode == 0, p.stderr
    plan = json.loads((calib / "plan.json").read_text())
    assert (plan["format"], plan["mx_scale_rounding"]) == scored
    out = tmp_path / "ck"
    argv = ["pack", str(model), "--calib", str(calib), "--plan", str(calib / "plan.json"), "--format", packed[0],
            "--mx-scale", packed[1], "--out", str(out)]
    p = run_main(*argv)
    err = p.stderr.strip()
    assert p.returncode == 2 and "\n" not in err and needle in err, p.stderr
    assert not out.exists()
    # The matching format packs.
    argv[argv.index("--format") + 1], argv[argv.index("--mx-scale") + 1] = scored
    assert run_main(*argv).returncode == 0
