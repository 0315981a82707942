"""`calibrate --weight-algo awq` → `pack` → `verify` on tiny random models of three architectures:
Llama (grouped-query attention: o_proj stays unscaled), Gemma 3 (norms multiply by ``1 + weight``,
the MLP's norm is ``pre_feedforward_layernorm``) and Qwen2 with multi-head attention (o_proj's
scales fold into v_proj's rows and bias).

The stored tensors are checked against smoothed weights computed here, independently of
`awq.Smoothing` (plain tensor arithmetic in the model dtype), and decoded with ModelOpt's and
compressed-tensors' own decoders.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from resserve_export.algorithms.awq import smoothing as awq
from resserve_export.algorithms.awq import pipeline
from resserve_export.algorithms.awq import search
from resserve_export.modeling import data
from resserve_export.core.errors import CheckpointMismatch, UserError
from resserve_export.formats import ops as formats
from resserve_export.modeling import modelio
from resserve_export.stages.calibrate import run as cal
from resserve_export.stages.calibrate.config import make_config
from resserve_export.stages.calibrate.linears import model_groups_of
from resserve_export.modeling.groups import group_linears
from resserve_export.storage.checkpoint import Checkpoint, read_checkpoint
from resserve_export.stages.pack.run import pack
from resserve_export.stages.verify.run import verify

from tests.fixtures.checkpoints import source_tensors
from tests.fixtures.models import make_llama, make_tokenized_gemma3, make_tokenized_qwen2_mha, varied_texts, write_jsonl




ARCHS = ("llama", "gemma3", "qwen2_mha")
# One worker runs the module: its three models and six calibrations are built once.
pytestmark = pytest.mark.xdist_group("awq")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq-pipeline")
    texts = write_jsonl(root / "docs.jsonl", varied_texts(10))
    models = {
        "llama": make_llama(root / "llama", dtype=torch.bfloat16),
        "gemma3": make_tokenized_gemma3(root / "gemma3"),
        "qwen2_mha": make_tokenized_qwen2_mha(root / "qwen2_mha"),
    }
    calibs = {}
    for arch, m in models.items():
        for algo in ("rtn", "awq"):
            cfg = make_config(
                "quick", dataset=str(texts), num_samples=6, seq_len=48, batch_size=3, device="cpu", scores="none",
                weight_algo=algo, awq_tokens=128,
            )
            calibs[arch, algo] = cal.calibrate(str(m), root / f"calib-{arch}-{algo}", cfg, show_progress=False).path
    return root, models, calibs, texts


def _independent_smoothing(src: dict[str, torch.Tensor], record: dict, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The smoothed tensors from the calibration's record, by plain arithmetic: per fold in model
    order, the producer divided by s (a norm's ``w`` or Gemma's ``1 + w``; a linear's rows and
    bias), the consumers' columns multiplied by s, each rounded to the tensor's dtype."""
    t = dict(src)
    for g in record["groups"]:
        if g["alpha"] is None:
            continue
        s = scales[f"{g['consumers'][0]}.awq_scales"]
        p = g["producer"]
        w = t[f"{p}.weight"]
        if g["fold"] == "norm":
            t[f"{p}.weight"] = (w.float() / s).to(w.dtype)
        elif g["fold"] == "norm_one_plus":
            t[f"{p}.weight"] = ((1 + w.float()) / s - 1).to(w.dtype)
        else:
            t[f"{p}.weight"] = (w.float() / s[:, None]).to(w.dtype)
            if f"{p}.bias" in t:
                b = t[f"{p}.bias"]
                t[f"{p}.bias"] = (b.float() / s).to(b.dtype)
        for c in g["consumers"]:
            cw = t[f"{c}.weight"]
            t[f"{c}.weight"] = (cw.float() * s).to(cw.dtype)
    return t


# ----------------------------------------------------------------------------- calibrate


@pytest.mark.parametrize("arch", ARCHS)
def test_calibration_records_the_search_and_describes_smoothed_activations(setup, arch):
    _, models, calibs, _ = setup
    c_awq, c_rtn = calibs[arch, "awq"], calibs[arch, "rtn"]
    meta = json.loads((c_awq / "calibration.json").read_text())
    rec = meta["weight_algo"]
    assert json.loads((c_rtn / "calibration.json").read_text())["weight_algo"] == {"name": "rtn"}
    assert not (c_rtn / awq.FILE).exists()
    assert rec["name"] == "awq" and rec["file"] == awq.FILE and rec["grid"] == list(search.GRID) and rec["format"] == "nvfp4"
    groups = rec["groups"]
    assert len(groups) == 4 * 2  # q/k/v, gate/up, o_proj, down_proj per layer
    o = [g for g in groups if g["consumers"][0].endswith("o_proj")]
    if arch == "qwen2_mha":
        assert all("unscaled" not in g or "grid" in g["unscaled"] for g in o)
    else:
        assert all("grouped-query" in g["unscaled"] for g in o)
    if arch == "gemma3":
        assert all(g["fold"] == "norm_one_plus" for g in groups if g["fold"] != "rows")
        assert any(g["producer"].endswith("pre_feedforward_layernorm") for g in groups)
    searched = [g for g in groups if "tokens" in g]
    smoothed = [g for g in searched if g["alpha"] is not None]
    assert smoothed and rec["smoothed_groups"] == len(smoothed)
    for g in smoothed:
        assert g["alpha"] in search.GRID and g["nmse"] < g["nmse_unsmoothed"] and g["tokens"] == 128
    scales = load_file(str(c_awq / awq.FILE))
    assert sorted(scales) == sorted(f"{g['consumers'][0]}.awq_scales" for g in smoothed)
    assert all(s.dtype == torch.float32 and bool((s > 0).all()) for s in scales.values())
    # Salience is measured after smoothing: the channel means are the unsmoothed ones over s
    # (exact in real arithmetic; bf16 rounding of the smoothed norms and rows aside).
    sal_awq, sal_rtn = load_file(str(c_awq / "salience.safetensors")), load_file(str(c_rtn / "salience.safetensors"))
    for g in smoothed:
        head = g["consumers"][0]
        s = scales[f"{head}.awq_scales"]
        got, want = sal_awq[f"{head}.mean_abs"], sal_rtn[f"{head}.mean_abs"] / s
        torch.testing.assert_close(got, want, rtol=0.03, atol=1e-6)
        assert not torch.allclose(got, sal_rtn[f"{head}.mean_abs"], rtol=0.03)


def test_awq_calibration_is_deterministic(setup, tmp_path):
    root, models, calibs, texts = setup
    cfg = make_config(
        "quick", dataset=str(texts), num_samples=6, seq_len=48, batch_size=3, device="cpu", scores="none", weight_algo="awq", awq_tokens=128
    )
    again = cal.calibrate(str(models["llama"]), tmp_path / "again", cfg, show_progress=False).path
    for name in (awq.FILE, "salience.safetensors", "kv_cache.safetensors"):
        assert (again / name).read_bytes() == (calibs["llama", "awq"] / name).read_bytes(), name


@pytest.mark.parametrize("arch", ARCHS)
def test_smoothed_bf16_model_matches_the_original_within_bf16_rounding(setup, arch):
    """The calibrated folds change the bf16 model's logits by no more than bf16 itself does:
    compared with the FP32 model, the smoothed bf16 model is as close as the plain bf16 one."""
    _, models, calibs, _ = setup
    meta = json.loads((calibs[arch, "awq"] / "calibration.json").read_text())
    smoothing = awq.Smoothing.from_calibration(calibs[arch, "awq"], meta)
    ids = torch.randint(0, 4000, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = modelio.load_model(models[arch], "float32")(input_ids=ids, use_cache=False).logits
        bf = modelio.load_model(models[arch], "bfloat16")
        plain = bf(input_ids=ids, use_cache=False).logits.float()
        smoothing.apply_to_model(bf)
        smooth = bf(input_ids=ids, use_cache=False).logits.float()
    err_plain, err_smooth = (plain - ref).norm() / ref.norm(), (smooth - ref).norm() / ref.norm()
    assert float(err_smooth) < 3 * float(err_plain) + 1e-3, (float(err_smooth), float(err_plain))
    assert not torch.equal(smooth, plain)  # the weights did change


# ----------------------------------------------------------------------------- pack


@pytest.mark.parametrize("arch", ARCHS)
def test_pack_stores_the_reference_quantization_of_the_smoothed_weights(setup, arch, tmp_path):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    _, models, calibs, _ = setup
    calib = calibs[arch, "awq"]
    meta = json.loads((calib / "calibration.json").read_text())
    src = source_tensors(models[arch])
    want = _independent_smoothing(src, meta["weight_algo"], load_file(str(calib / awq.FILE)))
    out = pack(models[arch], calib, tmp_path / "nv", "nvfp4", ratio=0.25, progress=False).out
    ck = Checkpoint(out)
    stored = {n: ck.model.get(n) for n in ck.model.keys()}
    # Unquantized tensors: the smoothed norms and biases, the rest unchanged.
    quantized = {f"{m}.weight" for m in ck.modules}
    changed = set()
    for n, t in stored.items():
        if n in src and n not in quantized:
            assert torch.equal(t, want[n]), n
            if not torch.equal(t, src[n]):
                changed.add(n)
    smoothed = [g for g in meta["weight_algo"]["groups"] if g["alpha"] is not None]
    expect = {f"{g['producer']}.weight" for g in smoothed if g["fold"].startswith("norm")}
    expect |= {f"{g['producer']}.bias" for g in smoothed if g["fold"] == "rows" and f"{g['producer']}.bias" in src}
    assert expect and changed == expect
    # Quantized linears: ModelOpt's decoder of the stored tensors equals the reference
    # quantization of the smoothed weights with the fused group's tensor scale.
    packed = read_checkpoint(out)
    for g in ck.groups:
        members = g["members"]
        alpha = torch.stack([want[f"{m}.weight"].float().abs().amax() for m in members]).max() / (6 * 448)
        for m in members:
            p = packed[m]
            ref = formats.quantize(want[f"{m}.weight"], "nvfp4", alpha=alpha.float(), backend="reference")
            assert torch.equal(p.base.codes, ref.codes), m
            dec = NVFP4QTensor(torch.Size(p.base.shape), torch.float32, p.base.codes).dequantize(
                dtype=torch.float32, scale=p.base.scales, double_scale=p.base.global_scale, block_sizes={-1: 16}
            )
            assert torch.equal(dec, ref.dequantize()), m
    # No tensor stock loaders do not know: the same names as a round-to-nearest pack.
    rtn = pack(models[arch], calibs[arch, "rtn"], tmp_path / "rtn", "nvfp4", ratio=0.25, progress=False).out
    assert sorted(Checkpoint(rtn).model.keys()) == sorted(stored)
    prov = ck.resserve["provenance"]["weight_algo"]
    assert prov["name"] == "awq" and prov["scales_sha256"] == awq.file_digest(calib / awq.FILE)
    assert "weight_algo" not in Checkpoint(rtn).resserve["provenance"]


def test_pack_mxfp4_decodes_with_compressed_tensors(setup, tmp_path):
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    _, models, calibs, texts = setup
    # AWQ scales are searched for one format: an NVFP4 search does not pack as MXFP4.
    with pytest.raises(UserError, match="searched for nvfp4 but --format is mxfp4"):
        pack(models["qwen2_mha"], calibs["qwen2_mha", "awq"], tmp_path / "refused", "mxfp4", ratio=0.25, progress=False)
    assert not (tmp_path / "refused").exists()
    cfg = make_config(
        "quick", dataset=str(texts), num_samples=6, seq_len=48, batch_size=3, device="cpu", scores="none",
        weight_algo="awq", awq_tokens=128, format="mxfp4", mx_scale="even",
    )
    calib = cal.calibrate(str(models["qwen2_mha"]), tmp_path / "calib-mx", cfg, show_progress=False).path
    meta = json.loads((calib / "calibration.json").read_text())
    assert meta["weight_algo"]["format"] == "mxfp4" and meta["weight_algo"]["mx_scale_rounding"] == "even"
    with pytest.raises(UserError, match="scale rounding even but --mx-scale is ceil"):
        pack(models["qwen2_mha"], calib, tmp_path / "refused", "mxfp4", ratio=0.25, progress=False)
    want = _independent_smoothing(source_tensors(models["qwen2_mha"]), meta["weight_algo"], load_file(str(calib / awq.FILE)))
    out = pack(models["qwen2_mha"], calib, tmp_path / "mx", "mxfp4", ratio=0.25, mx_scale="even", progress=False).out
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    qc.pop("resserve")
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    packed = read_checkpoint(out)
    for m in ("model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.up_proj"):
        q = packed[m].base
        dec = MXFP4PackedCompressor.decompress({"weight_packed": q.codes, "weight_scale": q.scales}, scheme)["weight"].float()
        assert torch.equal(dec, formats.qdq(want[f"{m}.weight"], "mxfp4", rounding="even", backend="reference")), m


def test_awq_calibration_packed_with_another_model_is_refused(setup, tmp_path):
    root, models, calibs, _ = setup
    other = make_llama(tmp_path / "other", seed=1, dtype=torch.bfloat16)
    with pytest.raises(UserError, match="fingerprint|other weights|not the model"):
        pack(other, calibs["llama", "awq"], tmp_path / "out", "nvfp4", ratio=0.0, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_damaged_awq_calibration_is_refused(setup, tmp_path):
    _, models, calibs, _ = setup
    bad = tmp_path / "calib"
    shutil.copytree(calibs["llama", "awq"], bad)
    (bad / awq.FILE).unlink()
    with pytest.raises(UserError, match="no awq.safetensors"):
        pack(models["llama"], bad, tmp_path / "out", "nvfp4", ratio=0.0, progress=False)
    scales = load_file(str(calibs["llama", "awq"] / awq.FILE))
    k = sorted(scales)[0]
    scales[k] = -scales[k]
    from safetensors.torch import save_file

    save_file(scales, str(bad / awq.FILE))
    with pytest.raises(UserError, match="not positive finite"):
        pack(models["llama"], bad, tmp_path / "out", "nvfp4", ratio=0.0, progress=False)


def test_unknown_weight_algo_is_one_line():
    with pytest.raises(UserError, match=r"unknown --weight-algo 'awq\+rtn': choose one of rtn, awq, gptq, awq\+gptq"):
        make_config("quick", weight_algo="awq+rtn")


# ----------------------------------------------------------------------------- verify


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_mha"])
def test_verify_reproduces_the_smoothed_quantization(setup, arch, tmp_path):
    root, models, calibs, texts = setup
    calib = calibs[arch, "awq"]
    out = pack(models[arch], calib, tmp_path / "nv", "nvfp4", ratio=0.25, progress=False).out
    rep = verify(out, str(models[arch]), text=str(texts), samples=2, seq_len=32, calib=calib, device="cpu")
    assert rep["weights_match_reference"] is True and rep["weight_algo"] == "awq"
    pooled = rep["nmse"]["pooled"]
    assert pooled["full"] < pooled["plain"] and pooled["plain"] < 0.2
    # The same checkpoint measured against the unsmoothed weights would be far off: the
    # reference is the original product, so a per-layer NMSE near 1 would mean a wrong reference.
    assert max(r["plain"] for r in rep["layers"]) < 0.5
    # Without the calibration, or with another one, verify cannot reproduce the weights.
    with pytest.raises(UserError, match="AWQ-smoothed weights: pass --calib"):
        verify(out, str(models[arch]), text=str(texts), samples=2, seq_len=32, device="cpu")
    with pytest.raises(CheckpointMismatch, match="other AWQ scales"):
        other = tmp_path / "other"
        shutil.copytree(calib, other)
        s = load_file(str(other / awq.FILE))
        from safetensors.torch import save_file

        save_file({k: v * 1.5 for k, v in s.items()}, str(other / awq.FILE))
        verify(out, str(models[arch]), text=str(texts), samples=2, seq_len=32, calib=other, device="cpu")
    rtn_ck = pack(models[arch], calibs[arch, "rtn"], tmp_path / "rtn", "nvfp4", ratio=0.0, progress=False).out
    with pytest.raises(CheckpointMismatch, match="packed without them"):
        verify(rtn_ck, str(models[arch]), text=str(texts), samples=2, seq_len=32, calib=calib, device="cpu")


def test_verify_catches_a_norm_that_is_not_the_smoothed_one(setup, tmp_path):
    from safetensors.torch import save_file

    _, models, calibs, texts = setup
    calib = calibs["llama", "awq"]
    out = pack(models["llama"], calib, tmp_path / "nv", "nvfp4", ratio=0.0, progress=False).out
    shard = next(out.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.1.input_layernorm.weight"
    tensors[name] = source_tensors(models["llama"])[name]  # the unsmoothed norm
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match="input_layernorm"):
        verify(out, str(models["llama"]), text=str(texts), samples=2, seq_len=32, calib=calib, device="cpu")


def test_search_rows_are_valid_tokens_only(setup):
    """The AWQ search sees exactly the first `awq_tokens` non-padding rows of each group input."""
    _, models, _, texts = setup
    tok = modelio.load_tokenizer(models["llama"])
    samples = data.make_samples(tok, data.load_documents(str(texts)), 6, 48, 42)
    batches = data.batches(samples, 3, data.pad_id(tok))
    assert any(not bool(b["attention_mask"].all()) for b in batches)  # there is padding
    model = modelio.load_model(models["llama"], "bfloat16")
    groups = group_linears({n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    valid = sum(int(b["attention_mask"].sum()) for b in batches)
    _, rec = pipeline.search_smoothing(model, batches, groups, "nvfp4", "ceil", max_rows=10**6)
    assert all(g["tokens"] == valid for g in rec["groups"] if "tokens" in g)


def test_awq_search_refuses_an_offloaded_model(setup):
    """Weights offloaded to disk (on the meta device) cannot be searched or smoothed: one line."""
    from resserve_export.stages.calibrate.shell import empty_model

    _, models, _, _ = setup
    shell = empty_model(models["llama"], "bfloat16")
    groups = model_groups_of(shell, models["llama"])
    with pytest.raises(UserError, match="needs the whole model in memory, but it was offloaded to disk"):
        pipeline.search_smoothing(shell, [], groups, "nvfp4", "ceil", 64)
