"""`calibrate --weight-algo gptq` (and ``awq+gptq``) → `pack` → `verify` on a tiny random Llama
and a tiny Qwen3-MoE: the checkpoint holds exactly the calibration's GPTQ tensors (the extension
built from their dequantized weights), a stock decoder reads them as ours, the output error on
the calibration text is below round to nearest's, and what GPTQ cannot do is one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from resserve_export.algorithms import gptq
from resserve_export.algorithms.kext import extend_weight
from resserve_export.algorithms.selection import select_mask
from resserve_export.core.errors import CheckpointMismatch, UserError
from resserve_export.formats import ops as formats
from resserve_export.modeling import data, modelio
from resserve_export.stages.calibrate import run as cal
from resserve_export.stages.calibrate.config import make_config
from resserve_export.stages.pack.run import pack
from resserve_export.stages.verify.run import verify
from resserve_export.storage.calibration import load_stats
from resserve_export.storage.checkpoint import read_checkpoint

from tests.fixtures.checkpoints import source_tensors
from tests.fixtures.console import assert_one_line_error, leftovers, run_main
from tests.fixtures.models import make_llama, varied_texts, write_jsonl
from tests.fixtures.tensors import bits


# One worker builds the module's model and calibrations (the MoE tests join the "moe" group instead).
GPTQ = pytest.mark.xdist_group("gptq")


def _config(texts, algo: str, **kw):
    kw = {"scores": "none", **kw}
    return make_config("quick", dataset=str(texts), num_samples=8, seq_len=64, batch_size=4, device="cpu", weight_algo=algo, awq_tokens=128, **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    texts = write_jsonl(root / "docs.jsonl", varied_texts(12))
    model = make_llama(root / "llama", dtype=torch.bfloat16, intermediate=256)
    calibs = {}
    for key, algo, kw in (
        ("rtn", "rtn", {"scores": "grad"}), ("gptq", "gptq", {"scores": "grad"}), ("awq+gptq", "awq+gptq", {}),
        ("gptq-mx", "gptq", {"format": "mxfp4", "mx_scale": "even"}), ("gptq-block", "gptq", {"gptq_order": "block"}),
    ):
        calibs[key] = cal.calibrate(str(model), root / f"calib-{key}", _config(texts, algo, **kw), show_progress=False).path
    return root, model, texts, calibs


def _meta(calib) -> dict:
    return json.loads((calib / "calibration.json").read_text())


@GPTQ
@pytest.mark.parametrize("key", ["gptq", "awq+gptq", "gptq-mx", "gptq-block"])
def test_pack_writes_the_calibrations_gptq_tensors(setup, key, tmp_path):
    """Every quantized linear's codes, block scales and tensor scale are the calibration's GPTQ
    tensors bit for bit; the extension is ``[W_S | 0]`` of their dequantized weights."""
    _, model, _, calibs = setup
    calib = calibs[key]
    rec = _meta(calib)["weight_algo"]
    assert rec["name"] == key.removesuffix("-mx").removesuffix("-block") and rec["gptq_file"] == gptq.FILE and rec["rounded_to_nearest"] == {}
    assert rec["gptq_order"] == ("block" if key.endswith("-block") else "activation")
    fmt, rounding = rec["format"], rec["mx_scale_rounding"] or "ceil"
    assert ("groups" in rec) == key.startswith("awq")  # the AWQ record is kept beside GPTQ's
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=0.25, mx_scale=rounding, progress=False).out
    ck = read_checkpoint(out)
    stored = gptq.from_calibration(calib, _meta(calib))
    stats = load_stats(calib)
    assert sorted(stored.modules) == sorted(ck) and len(ck) == 14
    for m in ck:
        pk, q = ck[m], stored.get(m)
        assert torch.equal(pk.base.codes, q.codes) and torch.equal(bits(pk.base.scales), bits(q.scales))
        if q.global_scale is not None:
            assert bits(pk.base.global_scale).item() == bits(q.global_scale).item()
        mask = select_mask(stats[m]["mean_abs"], 0.25)
        ext = extend_weight(q.dequantize(), mask, 0.25, fmt, rounding, alpha=q.global_scale, backend="reference")
        assert torch.equal(pk.mask, mask) and torch.equal(pk.ext.codes, ext.codes) and torch.equal(bits(pk.ext.scales), bits(ext.scales))
    shown = run_main("inspect", str(out)).stdout
    assert f"weights: GPTQ in {rec['gptq_order']} order" in shown.replace("\n", " "), shown
    assert ("weights: GPTQ" in shown) and (("weights: AWQ-smoothed" in shown) == key.startswith("awq")), shown
    # GPTQ moved codes away from round to nearest (the same α: only the error feedback differs)
    rtn = read_checkpoint(pack(model, calibs["rtn"], tmp_path / "rtn", fmt, ratio=0.0, mx_scale=rounding, progress=False).out)
    m = "model.layers.1.mlp.down_proj"
    if not key.startswith("awq"):
        assert not torch.equal(rtn[m].base.codes, ck[m].base.codes)


@GPTQ
def test_gptq_lowers_the_output_error_on_the_calibration_text(setup):
    """verify on the calibration's own text: plain W4A4 linear-output NMSE and perplexity of the
    GPTQ checkpoint below the round-to-nearest one's; the stored weights check out."""
    root, model, texts, calibs = setup
    reps = {}
    for key in ("rtn", "gptq", "gptq-block"):
        out = pack(model, calibs[key], root / f"verify-{key}", "nvfp4", ratio=0.0, progress=False).out
        reps[key] = verify(out, str(model), text=str(texts), samples=8, seq_len=64, calib=calibs[key], device="cpu")
    for key in ("gptq", "gptq-block"):
        assert reps[key]["weights_match_reference"] is True and reps[key]["weight_algo"] == "gptq"
    plain = {k: r["nmse"]["pooled"]["plain"] for k, r in reps.items()}
    assert plain["gptq"] < 0.97 * plain["rtn"] and plain["gptq-block"] < 0.97 * plain["rtn"], plain


@GPTQ
def test_grad_scores_are_those_of_the_gptq_weights(setup):
    """The planner's scores rate what pack will write: with GPTQ's base weights the damage of
    plain W4A4 summed over the groups is below round to nearest's, and every score is another."""
    _, _, _, calibs = setup
    s = {k: json.loads((calibs[k] / "scores.json").read_text()) for k in ("rtn", "gptq")}
    plain = {k: sum(g["scores"]["0"] for g in v["groups"]) for k, v in s.items()}
    assert plain["gptq"] < plain["rtn"], plain
    assert all(a["scores"]["0"] != b["scores"]["0"] for a, b in zip(s["rtn"]["groups"], s["gptq"]["groups"]))


@GPTQ
def test_verify_needs_the_calibration_the_checkpoint_was_packed_with(setup, tmp_path):
    root, model, texts, calibs = setup
    out = pack(model, calibs["gptq"], tmp_path / "ck", "nvfp4", ratio=0.125, progress=False).out
    kw = dict(text=str(texts), samples=2, seq_len=32, device="cpu")
    with pytest.raises(UserError, match="holds GPTQ-quantized weights: pass --calib"):
        verify(out, str(model), **kw)
    with pytest.raises(CheckpointMismatch, match="was packed without them"):
        verify(pack(model, calibs["rtn"], tmp_path / "rtn", "nvfp4", ratio=0.0, progress=False).out, str(model), calib=calibs["gptq"], **kw)
    other = tmp_path / "other"
    shutil.copytree(calibs["gptq"], other)
    t = load_file(str(other / gptq.FILE))
    name = next(n for n in t if n.endswith("gptq_codes"))
    t[name] = t[name] ^ 1
    save_file(t, str(other / gptq.FILE))
    with pytest.raises(CheckpointMismatch, match="other GPTQ weights"):
        verify(out, str(model), calib=other, **kw)


@GPTQ
def test_pack_refuses_gptq_weights_of_another_format(setup, tmp_path):
    _, model, _, calibs = setup
    p = run_main("pack", str(model), "--calib", str(calibs["gptq"]), "--format", "mxfp4", "--ratio", "0", "--out", str(tmp_path / "ck"))
    assert_one_line_error(p, 2, "GPTQ weights", "were quantized to nvfp4 but --format is mxfp4", "calibrate with --format mxfp4")
    assert leftovers(tmp_path / "ck") == []
    p = run_main("pack", str(model), "--calib", str(calibs["gptq-mx"]), "--format", "mxfp4", "--ratio", "0", "--out", str(tmp_path / "ck"))
    assert_one_line_error(p, 2, "scale rounding even but --mx-scale is ceil")


@GPTQ
def test_the_sequential_pipeline_gives_the_same_gptq_weights(setup, tmp_path):
    """Layer by layer (one layer's Hessians at a time, taken in the layer's own pass) GPTQ is the
    whole-model run's bit for bit, and so are the grad scores of its weights (within the two
    pipelines' float tolerance)."""
    _, model, texts, calibs = setup
    calib = cal.calibrate(str(model), tmp_path / "seq", _config(texts, "gptq", scores="grad", pipeline="sequential"), show_progress=False).path
    meta = _meta(calib)
    assert meta["pipeline"] == "sequential" and meta["weight_algo"] == _meta(calibs["gptq"])["weight_algo"]
    ours, whole = load_file(str(calib / gptq.FILE)), load_file(str(calibs["gptq"] / gptq.FILE))
    assert ours.keys() == whole.keys() and all(torch.equal(bits(ours[k]), bits(whole[k])) for k in ours)
    s_seq, s_whole = (json.loads((c / "scores.json").read_text())["groups"] for c in (calib, calibs["gptq"]))
    for a, b in zip(s_seq, s_whole):
        for r, v in a["scores"].items():
            assert v == pytest.approx(b["scores"][r], rel=1e-4, abs=1e-9), (a["modules"], r)


@pytest.fixture(scope="module")
def propagated(setup, tmp_path_factory):
    _, model, texts, _ = setup
    out = tmp_path_factory.mktemp("gptq-prop") / "prop"
    return cal.calibrate(str(model), out, _config(texts, "gptq", gptq_propagate=True), show_progress=False).path


def _served_model(model_dir, calib, modules):
    """The calibration's model with `modules` replaced by their GPTQ weights, dequantized (the
    inputs unquantized), and the batches calibrate ran."""
    from resserve_export.algorithms.emulate import DequantizedLinear, QuantizedWeight, swapped

    meta = _meta(calib)
    net = modelio.load_model(model_dir, meta["dtype"])
    stored = gptq.Stored(calib / gptq.FILE, "nvfp4")
    served = {m: DequantizedLinear(net.get_submodule(m), QuantizedWeight.from_stored("nvfp4", 0.0, "ceil", None, stored.get(m), None))
              for m in modules}
    tok = modelio.load_tokenizer(model_dir)
    cfg = meta["config"]
    samples = data.make_samples(tok, data.load_documents(cfg["dataset"]), cfg["num_samples"], cfg["seq_len"], cfg["seed"])
    return net, swapped(net, served), data.batches(samples, cfg["batch_size"], data.pad_id(tok))


@GPTQ
def test_propagated_gptq_takes_later_layers_through_the_quantized_earlier_ones(setup, propagated, tmp_path):
    """--gptq-propagate (the sequential pipeline picked for it): layer 0 sees the model's own
    inputs, so its GPTQ weights and statistics are the plain run's bit for bit; every later
    layer's inputs come through the quantized layers before it, so its statistics and GPTQ
    weights differ; the record says so and pack writes a checkpoint verify reads back."""
    root, model, texts, calibs = setup
    calib = propagated
    meta = _meta(calib)
    assert meta["pipeline"] == "sequential" and meta["weight_algo"]["propagate"] is True
    assert "propagate" not in _meta(calibs["gptq"])["weight_algo"]
    ours, plain = load_file(str(calib / gptq.FILE)), load_file(str(calibs["gptq"] / gptq.FILE))
    assert ours.keys() == plain.keys()
    first = [k for k in ours if ".layers.0." in k]
    later = [k for k in ours if ".layers.0." not in k and k.endswith("gptq_codes")]
    assert first and len(later) == 7
    assert all(torch.equal(bits(ours[k]), bits(plain[k])) for k in first)
    assert all(not torch.equal(ours[k], plain[k]) for k in later)
    s_prop, s_plain = load_stats(calib), load_stats(calibs["gptq"])
    for name in s_prop:
        same = torch.equal(s_prop[name]["mean_abs"], s_plain[name]["mean_abs"])
        assert same == (".layers.0." in name), name
    out = pack(model, calib, root / "verify-prop", "nvfp4", ratio=0.0, progress=False).out
    rep = verify(out, str(model), text=str(texts), samples=4, seq_len=32, calib=calib, device="cpu")
    assert rep["weights_match_reference"] is True


@GPTQ
def test_propagation_oracles_a_served_whole_model(setup, propagated):
    """What --gptq-propagate computes, against the whole model with layer 0's GPTQ weights put in
    by hand (dequantized, its inputs unquantized, as llm-compressor propagates GPTQ): layer 1's
    statistics are that model's, and layer 1's q/k/v are GPTQ on the Hessian their input has
    there, bit for bit."""
    from resserve_export.modeling.groups import group_linears, linears_of
    from resserve_export.observers.hessian import HessianCollector
    from resserve_export.observers.stats import collect

    _, model, _, _ = setup
    stored = gptq.Stored(propagated / gptq.FILE, "nvfp4")
    net, served, batches = _served_model(model, propagated, [m for m in stored.modules if ".layers.0." in m])
    groups = group_linears(linears_of(net))
    g = next(g for g in groups if g.modules[0] == "model.layers.1.self_attn.q_proj")
    with served:
        stats, _ = collect(net, batches, groups)
        with HessianCollector(net, [g.modules[0]]) as hc, torch.inference_mode():
            for b in batches:
                hc.set_mask(b["attention_mask"])
                net(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
                hc.end_batch()
            h, rows = hc.take(g.modules[0])
    got = load_stats(propagated)
    ones = [m for m in got if ".layers.1." in m]
    assert len(ones) == 7 and all(torch.equal(stats[m]["mean_abs"], got[m]["mean_abs"]) for m in ones)
    out: dict = {}
    gptq.quantize_group(g, [net.get_submodule(m).weight.detach() for m in g.modules], h, rows, "nvfp4", "ceil", out, {})
    for m in g.modules:
        mine = stored.get(m)
        assert torch.equal(out[m].codes, mine.codes) and torch.equal(bits(out[m].scales), bits(mine.scales)), m


@GPTQ
@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--weight-algo", "awq+gptq", "--pipeline", "sequential"], "--weight-algo awq+gptq needs --pipeline whole for now"),
        (["--weight-algo", "gptq", "--pipeline", "sequential", "--resume"], "--resume does not continue a GPTQ calibration"),
        (["--weight-algo", "spqr"], "unknown --weight-algo 'spqr': choose one of rtn, awq, gptq, awq+gptq"),
        (["--weight-algo", "gptq", "--gptq-order", "random"], "--gptq-order must be one of activation, block, got 'random'"),
        (["--weight-algo", "rtn", "--gptq-propagate"], "--gptq-propagate goes with --weight-algo gptq, not rtn"),
        (["--weight-algo", "gptq", "--gptq-propagate", "--pipeline", "whole"], "--gptq-propagate runs layer by layer: pass --pipeline sequential"),
    ],
)
def test_what_gptq_does_not_do_is_one_line(setup, extra, needle, tmp_path):
    _, model, texts, _ = setup
    out = tmp_path / "calib"
    args = ["calibrate", str(model), "--out", str(out), "--config", "quick", "--dataset", str(texts), "--device", "cpu", "--scores", "none"]
    p = run_main(*args, *extra)
    assert_one_line_error(p, 2, needle)
    assert leftovers(out) == []


@GPTQ
def test_a_singular_hessian_is_one_line(setup, monkeypatch, tmp_path):
    """A Hessian that no damping makes positive definite stops calibrate with the linear's name."""
    _, model, texts, _ = setup

    def broken(h, damp=gptq.DAMP):
        raise gptq.SingularHessian(f"it is not positive definite even with damping {damp:g}")

    monkeypatch.setattr(gptq, "inverse_factor", broken)
    with pytest.raises(UserError, match=r"GPTQ cannot quantize model\.layers\.0\.self_attn\.q_proj\+.*singular .*not positive definite"):
        cal.calibrate(str(model), tmp_path / "c", _config(texts, "gptq"), show_progress=False)
    assert not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------- mixture of experts


@pytest.mark.xdist_group("moe")
def test_experts_are_quantized_each_on_its_routed_tokens(moe, tmp_path):
    """Qwen3-MoE: every expert its own GPTQ linear on the tokens routed to it. Layer 0's router
    is rewritten so that expert i's logit is (1 + i/10)·(x·u) for odd i and −(1 + i/10)·(x·u) for
    even i (0 for i = 0): nearly every token goes to experts 7 and 5 or to 6 and 4, and some
    experts see no token. Those, counted here from the router's own choices on the calibration's
    valid tokens, are rounded to nearest (bit for bit) and calibration.json lists them."""
    src = moe["models"]["qwen3_moe"]
    model = tmp_path / "model"
    shutil.copytree(src, model)
    name = "model.layers.0.mlp.gate.weight"
    for f in sorted(model.glob("*.safetensors")):
        t = load_file(str(f))
        if name in t:
            r = t[name].float()
            u = torch.randn(r.shape[1], generator=torch.Generator().manual_seed(0))
            r[:] = torch.stack([(1 + i / 10) * (u if i % 2 else -u) for i in range(r.shape[0])])
            r[0] = 0
            t[name] = r.to(t[name].dtype)
            save_file(t, str(f), metadata={"format": "pt"})
    cfg = make_config("quick", dataset=str(moe["texts"]), num_samples=7, seq_len=48, batch_size=3, device="cpu", scores="none", weight_algo="gptq")
    calib = cal.calibrate(str(model), tmp_path / "calib", cfg, show_progress=False).path

    # the oracle: layer 0's routing of the calibration's valid tokens
    net = modelio.load_model_on(model, "cpu", cfg.dtype)
    tok = modelio.load_tokenizer(model)
    batches = data.batches(data.make_samples(tok, data.load_documents(cfg.dataset), 7, 48, cfg.seed), 3, data.pad_id(tok))
    counts = torch.zeros(8, dtype=torch.long)
    valid = {}

    def count(mod, args, out):
        counts.add_(torch.bincount(out[2][valid["m"]].reshape(-1), minlength=8))

    hook = net.model.layers[0].mlp.gate.register_forward_hook(count)
    with torch.inference_mode():
        for b in batches:
            valid["m"] = b["attention_mask"].reshape(-1).bool()
            net(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    hook.remove()
    starved = {f"model.layers.0.mlp.experts.{e}.{p}" for e in range(8) if counts[e] == 0 for p in ("gate_proj", "up_proj", "down_proj")}
    assert starved and len(starved) < 24, counts

    rec = _meta(calib)["weight_algo"]
    assert set(rec["rounded_to_nearest"]) == starved
    out = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    ck = read_checkpoint(out)
    stored = gptq.from_calibration(calib, _meta(calib))
    experts = [m for m in ck if ".experts." in m]
    assert len(experts) == 2 * 8 * 3
    src_t = source_tensors(model)
    for m in experts:
        assert torch.equal(ck[m].base.codes, stored.get(m).codes)
        rtn = formats.quantize(src_t[f"{m}.weight"], "nvfp4", alpha=ck[m].base.global_scale, backend="reference")
        assert torch.equal(rtn.codes, ck[m].base.codes) == (m in starved), m
    rep = verify(out, str(model), text=str(moe["texts"]), samples=2, seq_len=32, calib=calib, device="cpu")
    assert rep["weights_match_reference"] is True and rep["weight_algo"] == "gptq"


@pytest.mark.xdist_group("moe")
def test_gpt_oss_experts_take_gptq_through_their_own_activation(moe, tmp_path):
    """gpt-oss (experts fused on disk, interleaved, with biases and a clamped SwiGLU): each expert
    is quantized by GPTQ on the inputs its own forward gives it, and verify reads it back; packed
    in the hub's MXFP4 layout, the experts hold the same GPTQ codes and scales."""
    model = moe["models"]["gpt_oss"]
    cfg = make_config(
        "quick", dataset=str(moe["texts"]), num_samples=7, seq_len=48, batch_size=3, device="cpu", scores="none", weight_algo="gptq",
        format="mxfp4",
    )
    calib = cal.calibrate(str(model), tmp_path / "calib", cfg, show_progress=False).path
    rec = _meta(calib)["weight_algo"]
    out = pack(model, calib, tmp_path / "ck", "mxfp4", ratio=0.25, progress=False).out
    ck = read_checkpoint(out)
    stored = gptq.from_calibration(calib, _meta(calib))
    experts = [m for m in ck if ".experts." in m]
    assert len(experts) == 2 * 4 * 3 and sorted(stored.modules) == sorted(ck)
    assert rec["quantized"] == len(ck) and set(rec["rounded_to_nearest"]) < set(experts)
    for m in ck:
        assert torch.equal(ck[m].base.codes, stored.get(m).codes) and torch.equal(ck[m].base.scales, stored.get(m).scales)
    rep = verify(out, str(model), text=str(moe["texts"]), samples=2, seq_len=32, calib=calib, device="cpu")
    assert rep["weights_match_reference"] is True and rep["weight_algo"] == "gptq"
    # the hub's MXFP4 layout (pack --experts-layout hub) holds GPTQ's expert codes too
    hub = read_checkpoint(pack(model, calib, tmp_path / "hub", "mxfp4", ratio=0.0, experts_layout="hub", progress=False).out)
    assert sorted(hub) == sorted(experts)
    for m in hub:
        assert torch.equal(hub[m].base.codes, stored.get(m).codes) and torch.equal(hub[m].base.scales, stored.get(m).scales)
    p = run_main(
        "calibrate", str(model), "--out", str(tmp_path / "c2"), "--config", "quick", "--dataset", str(moe["texts"]), "--device", "cpu",
        "--scores", "none", "--format", "mxfp4", "--weight-algo", "awq+gptq",
    )
    assert_one_line_error(p, 2, "--weight-algo awq+gptq: gpt-oss's clamped SwiGLU", "nothing was calibrated")
