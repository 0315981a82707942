"""AWQ (`calibrate --weight-algo awq`) for mixture-of-experts models: tiny random Qwen3-MoE and
Mixtral (grouped-query attention: o_proj stays unscaled), DeepSeek-V3 (MLA attention, a dense first
layer, a shared expert, a router the model holds in float32) and Qwen2-MoE (a shared expert and its
sigmoid gate), from test_moe's builders.

Per MoE layer one scale vector folds into the norm before the experts and multiplies the columns of
every expert's gate/up, the shared expert's and the routers'; each expert's down_proj gets its own,
folded into its up_proj rows. The stored tensors are checked against smoothing computed here from
calibration.json by plain tensor arithmetic, independently of `awq.Smoothing`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from resserve_export.algorithms.awq import smoothing as awq
from resserve_export.algorithms.awq import decoder
from resserve_export.algorithms.awq import pipeline
from resserve_export.algorithms.awq import search
from resserve_export.algorithms.awq import fold
from resserve_export.modeling import data
from resserve_export.formats import ops as formats
from resserve_export.modeling import modelio
from resserve_export.formats import nvfp4
from resserve_export.stages.calibrate import run as cal
from resserve_export.stages.calibrate.config import make_config
from resserve_export.stages.calibrate.linears import model_groups_of
from resserve_export.storage.checkpoint import Checkpoint, read_checkpoint
from resserve_export.core.errors import CheckpointMismatch
from resserve_export.formats.ops import qdq
from resserve_export.modeling.experts import checkpoint_parameters, expert_blocks, fused_modules
from resserve_export.modeling.groups import is_quantized
from resserve_export.stages.pack.run import pack
from resserve_export.stages.verify.run import verify

from tests.fixtures.checkpoints import source_tensors
from tests.fixtures.moe import calibrated
from tests.fixtures.tensors import bits

# The session's MoE models and their cached calibrations (tests.fixtures.moe) are built once:
# under pytest-xdist (--dist loadgroup) every MoE test runs on one worker.
pytestmark = pytest.mark.xdist_group("moe")


ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe"]
AWQ_TOKENS = 128


def _awq_config(moe, fmt: str = "nvfp4", mode: str = "all"):
    """test_moe's calibration settings (the same samples), with AWQ."""
    return make_config(
        "quick", dataset=str(moe["texts"]), num_samples=7, seq_len=48, batch_size=3, device="cpu", scores="none", moe_calib=mode,
        weight_algo="awq", awq_tokens=AWQ_TOKENS, format=fmt,
    )


def _awq(moe, arch: str, fmt: str = "nvfp4") -> Path:
    key = (arch, "awq", fmt)
    if key not in moe["calib"]:
        out = moe["root"] / f"calib-{arch}-awq-{fmt}"
        moe["calib"][key] = cal.calibrate(str(moe["models"][arch]), out, _awq_config(moe, fmt), show_progress=False).path
    return moe["calib"][key]


def _meta(calib: Path) -> dict:
    return json.loads((calib / "calibration.json").read_text())


def _independent_smoothing(src: dict[str, torch.Tensor], record: dict, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The smoothed checkpoint tensors from the calibration's record, by plain arithmetic: per fold
    in model order, the producer divided by s (a norm's weight; a linear's rows, or with a row
    layout its rows offset … stride − 1 of every block), the consumers' and readers' columns
    multiplied by s, each rounded to the tensor's dtype."""
    t = dict(src)
    for g in record["groups"]:
        if g["alpha"] is None:
            continue
        s = scales[f"{g['consumers'][0]}.awq_scales"]
        p = f"{g['producer']}.weight"
        w = t[p]
        if g["fold"] == "norm":
            t[p] = (w.float() / s).to(w.dtype)
        else:
            r = s
            if g.get("rows"):
                stride, offset = g["rows"]
                r = torch.ones(w.shape[0] // stride, stride)
                r[:, offset:] = s.reshape(r.shape[0], -1)
                r = r.reshape(-1)
            t[p] = (w.float() / r[:, None]).to(w.dtype)
        for c in g["consumers"] + g.get("readers", []):
            cw = t[f"{c}.weight"]
            t[f"{c}.weight"] = (cw.float() * s).to(cw.dtype)
    return t


def _routing(net, blocks, ids, mask) -> tuple[torch.Tensor, dict, dict]:
    """(logits, {block: sorted top-k experts per token}, {block: router logits}) of one forward."""
    topk, logits, handles = {}, {}, []
    for prefix, mod in fused_modules(net, blocks).items():
        handles.append(mod.register_forward_pre_hook(
            lambda _m, a, _k, p=prefix: topk.__setitem__(p, a[1].sort(-1).values.clone()), with_kwargs=True))
        router = net.get_submodule(f"{[n for n, m in net.named_modules() if m is mod][0].rpartition('.')[0]}.gate")
        handles.append(router.register_forward_hook(lambda _m, _a, out, p=prefix: logits.__setitem__(p, out[0].float().clone())))
    try:
        with torch.no_grad():
            out = net(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    finally:
        for h in handles:
            h.remove()
    return out, topk, logits


def _tokens():
    ids = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


# ----------------------------------------------------------------------------- exact folds


@pytest.mark.parametrize("arch", ARCHS)
def test_every_fold_with_random_scales_leaves_the_fp32_model_unchanged(moe, arch):
    """Every fold the planner allows, with random scales over two orders of magnitude, in float32:
    logits equal the original's to float32 rounding (atol 1e-5 on logits of magnitude ~1), the
    routing of every token is unchanged, and every quantized linear's input is scaled except
    o_proj under grouped-query attention."""
    path = moe["models"][arch]
    shapes = modelio.tensor_shapes(path)
    blocks = expert_blocks(shapes)
    net = modelio.load_model(path, "float32")
    ids, mask = _tokens()
    ref, ref_topk, _ = _routing(net, blocks, ids, mask)
    folds = decoder.plan_folds(net, blocks, shapes)
    params = checkpoint_parameters(net, blocks)
    g = torch.Generator().manual_seed(1)
    for f in folds:
        if f.unscaled is None:
            k = params[f"{f.consumers[0]}.weight"].shape[-1]
            awq.apply_fold(net, f, torch.exp(torch.empty(k).uniform_(-2.3, 2.3, generator=g)), params)
    got, got_topk, _ = _routing(net, blocks, ids, mask)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert all(torch.equal(got_topk[p], ref_topk[p]) for p in ref_topk)
    # what is scaled: every quantized linear's input, but o_proj under grouped-query attention
    scaled = {c for f in folds if f.unscaled is None for c in f.consumers}
    quantized = {n[: -len(".weight")] for n, (_, s) in shapes.items() if len(s) == 2 and n.endswith(".weight") and "norm" not in n
                 and "embed" not in n and is_quantized(n[: -len(".weight")])} - {"lm_head"}
    unscaled = quantized - scaled
    if arch == "deepseek_v3":
        assert unscaled == set()  # MLA folds exactly everywhere, o_proj into kv_b_proj's value rows
        o = [f for f in folds if f.consumers == ("model.layers.1.self_attn.o_proj",)][0]
        assert o.producer == "model.layers.1.self_attn.kv_b_proj" and o.rows == (32, 16)
    else:
        assert unscaled == {f"model.layers.{i}.self_attn.o_proj" for i in (0, 1)}
        assert all("grouped-query" in f.unscaled for f in folds if f.unscaled)
    # one fold per MoE layer reaches every expert's gate/up and the routers
    for b in blocks:
        f = next(f for f in folds if b.module(0, "gate") in f.consumers)
        assert f.producer.endswith("post_attention_layernorm")
        assert {b.module(e, r) for e in range(b.num_experts) for r in ("gate", "up")} <= set(f.consumers)
        parent = b.prefix.rpartition(".")[0]
        want = [f"{parent}.gate"] + ([f"{parent}.shared_expert_gate"] if arch == "qwen2_moe" else [])
        assert list(f.readers) == want
        shared = {"deepseek_v3": "shared_experts", "qwen2_moe": "shared_expert"}.get(arch)
        if shared:
            assert f"{parent}.{shared}.gate_proj" in f.consumers and f"{parent}.{shared}.up_proj" in f.consumers


@pytest.mark.parametrize("arch", ARCHS)
def test_calibrated_smoothing_keeps_the_bf16_model_and_its_routing(moe, arch):
    """The calibrated folds, in bf16 as the checkpoint stores them: compared with the float32 model,
    the smoothed bf16 model's logits are as close as the plain bf16 model's (relative Frobenius
    error at most 1.5x, and the two bf16 models within 2^-6 of each other). The router logits move
    by bf16 rounding only (at most 4 bf16 ulps of their largest magnitude, 4 · 2^-8 relative), so a
    token's top-k can change only where its k-th and (k+1)-th original logits are closer than twice
    that move: such near-ties are the only routing differences, on at most 5% of the tokens."""
    path = moe["models"][arch]
    shapes = modelio.tensor_shapes(path)
    blocks = expert_blocks(shapes)
    calib = _awq(moe, arch)
    smoothing = awq.Smoothing.from_calibration(calib, _meta(calib), shapes)
    ids, mask = _tokens()
    exact, _, _ = _routing(modelio.load_model(path, "float32"), blocks, ids, mask)
    bf = modelio.load_model(path, "bfloat16")
    plain, topk, logits = _routing(bf, blocks, ids, mask)
    smoothing.apply_to_model(bf, checkpoint_parameters(bf, blocks))
    smooth, topk_s, logits_s = _routing(bf, blocks, ids, mask)
    err_plain, err_smooth = float((plain - exact).norm() / exact.norm()), float((smooth - exact).norm() / exact.norm())
    assert err_smooth <= 1.5 * err_plain, (err_smooth, err_plain)
    assert float((smooth - plain).norm() / plain.norm()) < 2**-6
    assert not torch.equal(smooth, plain)  # the weights did change
    for p in topk:
        move = float((logits_s[p] - logits[p]).abs().max())
        assert move <= 4 * 2**-8 * float(logits[p].abs().max()), (p, move)
        k = topk[p].shape[-1]
        ranked = logits[p].sort(-1, descending=True).values
        gap = ranked[:, k - 1] - ranked[:, k]
        flipped = (topk[p] != topk_s[p]).any(-1)
        assert int(flipped.sum()) <= 0.05 * flipped.numel(), (p, int(flipped.sum()))
        assert bool((gap[flipped] <= 2 * move).all()), (p, gap[flipped].tolist(), move)


def test_deepseek_router_is_smoothed_from_its_stored_bf16_value(moe):
    """DeepSeek's router is float32 in the loaded model but bf16 on disk: the calibration smooths the
    model to the stored value (bf16 of the original times s), so what is calibrated is what is packed."""
    path = moe["models"]["deepseek_v3"]
    shapes = modelio.tensor_shapes(path)
    blocks = expert_blocks(shapes)
    calib = _awq(moe, "deepseek_v3")
    rec = next(g for g in _meta(calib)["weight_algo"]["groups"] if g.get("readers"))
    s = load_file(str(calib / awq.FILE))[f"{rec['consumers'][0]}.awq_scales"]
    net = modelio.load_model(path, "bfloat16")
    router = net.get_submodule("model.layers.1.mlp.gate").weight
    assert router.dtype == torch.float32
    awq.Smoothing.from_calibration(calib, _meta(calib), shapes).apply_to_model(net, checkpoint_parameters(net, blocks))
    src = source_tensors(path)["model.layers.1.mlp.gate.weight"]
    assert torch.equal(router.detach(), (src.float() * s).to(torch.bfloat16).float())


# ----------------------------------------------------------------------------- calibrate


def test_calibration_records_the_moe_search_and_describes_smoothed_activations(moe):
    """calibration.json lists the MoE folds with their α; salience is measured after smoothing: with
    --moe-calib all every expert's gate/up mean |x| is the unsmoothed one over the layer's s, its
    down_proj's over the expert's own s (bf16 rounding aside)."""
    arch = "qwen3_moe"
    calib, rtn = _awq(moe, arch), calibrated(moe, arch, "all")
    rec = _meta(calib)["weight_algo"]
    assert rec["name"] == "awq" and rec["grid"] == list(search.GRID) and "moe" in rec and rec["search_tokens"] == AWQ_TOKENS
    scales = load_file(str(calib / awq.FILE))
    smoothed = [g for g in rec["groups"] if g["alpha"] is not None]
    assert rec["smoothed_groups"] == len(smoothed) and sorted(scales) == sorted(f"{g['consumers'][0]}.awq_scales" for g in smoothed)
    blocks = expert_blocks(modelio.tensor_shapes(moe["models"][arch]))
    sal_awq, sal_rtn = load_file(str(calib / "salience.safetensors")), load_file(str(rtn / "salience.safetensors"))
    for b in blocks:
        g = next(g for g in rec["groups"] if g["consumers"][0] == b.module(0, "gate"))
        assert g["readers"] == [b.prefix.rpartition(".")[0] + ".gate"] and g["tokens"] == AWQ_TOKENS
        assert len(g["consumers"]) == 2 * b.num_experts
        if g["alpha"] is not None:
            assert g["alpha"] in search.GRID and g["nmse"] < g["nmse_unsmoothed"]
            s = scales[f"{b.module(0, 'gate')}.awq_scales"]
            for e in range(b.num_experts):
                m = b.module(e, "gate")
                torch.testing.assert_close(sal_awq[f"{m}.mean_abs"], sal_rtn[f"{m}.mean_abs"] / s, rtol=0.03, atol=1e-6)
        for e in range(b.num_experts):
            d = next(g for g in rec["groups"] if g["consumers"] == [b.module(e, "down")])
            assert d["producer"] == b.module(e, "up") and d["fold"] == "rows" and 0 < d["tokens"] < AWQ_TOKENS
            if d["alpha"] is not None:
                m = b.module(e, "down")
                want = sal_rtn[f"{m}.mean_abs"] / scales[f"{m}.awq_scales"]
                torch.testing.assert_close(sal_awq[f"{m}.mean_abs"], want, rtol=0.05, atol=1e-5)


def _search_rows(moe, arch: str, layer_prefix: str):
    """The AWQ search's rows of one expert block, independently: the first AWQ_TOKENS valid tokens
    at the experts' input of the unsmoothed model (transformers' own forward) and their top-k."""
    path = moe["models"][arch]
    cfg = _awq_config(moe)
    tok = modelio.load_tokenizer(path)
    batches = data.batches(data.make_samples(tok, data.load_documents(cfg.dataset), cfg.num_samples, cfg.seq_len, cfg.seed),
                           cfg.batch_size, data.pad_id(tok))
    net = modelio.load_model(path)
    blocks = expert_blocks(modelio.tensor_shapes(path))
    mod = fused_modules(net, blocks)[layer_prefix]
    xs, idx, state = [], [], {}

    def keep(_m, args, _kwargs):
        xs.append(args[0][state["v"]])
        idx.append(args[1][state["v"]])

    h = mod.register_forward_pre_hook(keep, with_kwargs=True)
    with torch.inference_mode():
        for b in batches:
            state["v"] = b["attention_mask"].reshape(-1).bool()
            net(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
    h.remove()
    return net, mod, torch.cat(xs)[:AWQ_TOKENS], torch.cat(idx)[:AWQ_TOKENS]


def _w4a4(parts, s) -> float:
    """Pooled NMSE of (x, weights, amax rows) parts under NVFP4 W4A4 with scales s, by hand:
    weights times s with the group's tensor scale, x over s with the static scale of the amax rows
    over s, both through the reference quantizer."""
    err = ref = 0.0
    for x, ws, amax_rows in parts:
        xs = x.float() / s
        alpha_x = ((amax_rows.float() / s).abs().amax() / (6 * 448)).float()
        alpha_w = (torch.stack([(w.float() * s).abs().amax() for w in ws]).max() / (6 * 448)).float()
        xq = qdq(xs, "nvfp4", alpha=alpha_x, backend="reference")
        for w in ws:
            y = x.float() @ w.float().T
            yq = xq @ qdq(w.float() * s, "nvfp4", alpha=alpha_w, backend="reference").T
            err += float((yq - y).double().square().sum())
            ref += float(y.double().square().sum())
    return err / ref


def test_the_chosen_alpha_minimises_the_moe_objective(moe):
    """Brute force on Mixtral's last layer: every grid α's pooled W4A4 error of every expert's
    gate/up on its routed search tokens (activation scale from every token's amax: --moe-calib all),
    recomputed by hand; the recorded α is the grid's minimum (ties to the smaller α) and its NMSE
    the hand-computed one. The same for one expert's down_proj on its routed tokens."""
    arch, prefix = "mixtral", "model.layers.1.block_sparse_moe.experts"
    calib = _awq(moe, arch)
    rec = _meta(calib)["weight_algo"]
    net, mod, x, idx = _search_rows(moe, arch, prefix)
    E, I = mod.gate_up_proj.shape[0], mod.gate_up_proj.shape[1] // 2
    W = mod.gate_up_proj.detach()
    norm = net.get_submodule("model.layers.1.post_attention_layernorm").weight.detach()
    parts = [(x[(idx == e).any(-1)], [W[e, :I], W[e, I:]], x) for e in range(E)]
    assert all(len(p[0]) for p in parts)
    mean_x = x.float().abs().mean(0)
    mean_w = (W.abs().sum((0, 1), dtype=torch.float64) / (E * 2 * I)).float()

    def brute(parts, mean_x, mean_w, realize):
        return {a: _w4a4(parts, realize(search.candidate_scales(mean_x, mean_w, a))) for a in search.GRID}

    def check(g, scores, parts):
        none = _w4a4(parts, torch.ones_like(mean_x))
        assert g["nmse_unsmoothed"] == pytest.approx(none, rel=1e-6)
        best = min(scores, key=lambda a: (scores[a], a))
        if scores[best] < none:
            assert g["alpha"] == best and g["nmse"] == pytest.approx(scores[best], rel=1e-6)
        else:
            assert g["alpha"] is None

    g = next(g for g in rec["groups"] if g["consumers"][0] == f"{prefix}.0.w1")
    check(g, brute(parts, mean_x, mean_w, lambda s: fold.realized_norm_scales(norm, s)), parts)
    assert g["alpha"] is not None  # this layer is smoothed: the minimum beats no smoothing
    # one expert's down_proj, on act(gate) · up of its routed tokens (as the bf16 model computes it)
    e = 1
    gate, up = (x @ W[e].t()).chunk(2, dim=-1)
    h_all = F.silu(gate) * up
    h = h_all[(idx == e).any(-1)]
    down = mod.down_proj.detach()[e]
    d = next(g for g in rec["groups"] if g["consumers"] == [f"{prefix}.{e}.w2"])
    parts = [(h, [down], h_all)]
    mean_x = h.float().abs().mean(0)
    mean_w = down.float().abs().mean(0)
    check(d, brute(parts, mean_x, mean_w, lambda s: s), parts)
    assert d["tokens"] == len(h)


def test_an_expert_no_search_token_reached_stays_unscaled(moe):
    """With 3 search tokens (top-2 of 8 experts) some experts see none: their down_proj folds are
    recorded unscaled with no scales stored, and the layer's gate/up fold names them."""
    path = moe["models"]["qwen3_moe"]
    shapes = modelio.tensor_shapes(path)
    blocks = expert_blocks(shapes)
    net, _, _, idx = _search_rows(moe, "qwen3_moe", blocks[0].prefix)
    seen = set(idx[:3].reshape(-1).tolist())
    assert len(seen) < blocks[0].num_experts
    cfg = _awq_config(moe)
    tok = modelio.load_tokenizer(path)
    batches = data.batches(data.make_samples(tok, data.load_documents(cfg.dataset), cfg.num_samples, cfg.seq_len, cfg.seed),
                           cfg.batch_size, data.pad_id(tok))
    groups = model_groups_of(net, path, blocks)
    smoothing, rec = pipeline.search_smoothing(net, batches, groups, "nvfp4", "ceil", 3, blocks=blocks, shapes=shapes)
    b = blocks[0]
    for e in range(b.num_experts):
        d = next(g for g in rec["groups"] if g["consumers"] == [b.module(e, "down")])
        if e in seen:
            assert d["tokens"] >= 1 and "no search token" not in d.get("unscaled", "")
        else:
            assert d["alpha"] is None and d["unscaled"] == "no search token was routed to this expert"
            assert smoothing.row_scale(b.module(e, "up")) is None and smoothing.scale_for((b.module(e, "down"),)) is None
    g = next(g for g in rec["groups"] if g["consumers"][0] == b.module(0, "gate"))
    assert g["experts_without_search_tokens"] == [b.module(e, "gate") for e in range(b.num_experts) if e not in seen]


# ----------------------------------------------------------------------------- pack


@pytest.mark.parametrize("arch,fmt", [(a, "nvfp4") for a in ARCHS] + [("qwen2_moe", "mxfp4")])
def test_pack_stores_the_reference_quantization_of_the_smoothed_experts(moe, arch, fmt, tmp_path):
    """A plain ModelOpt NVFP4 / compressed-tensors MXFP4 checkpoint: every quantized linear (experts
    per expert) decodes to the reference quantization of its smoothed weight, an expert's gate and up
    sharing weight_scale_2; norms smoothed; routers (and Qwen2-MoE's shared_expert_gate) stored in
    bf16 as the original times s on their columns, named in the ignore list."""
    model, calib = moe["models"][arch], _awq(moe, arch, fmt)
    meta = _meta(calib)
    src = source_tensors(model)
    want = _independent_smoothing(src, meta["weight_algo"], load_file(str(calib / awq.FILE)))
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=0.25, progress=False).out
    ck = Checkpoint(out)
    quantized = {f"{m}.weight" for m in ck.modules}
    changed = set()
    for n in ck.model.keys():
        if n in src and n not in quantized:
            t = ck.model.get(n)
            assert t.dtype == src[n].dtype and torch.equal(t, want[n]), n
            if not torch.equal(t, src[n]):
                changed.add(n)
    smoothed = [g for g in meta["weight_algo"]["groups"] if g["alpha"] is not None]
    routers = {f"{r}.weight" for g in smoothed for r in g.get("readers", [])}
    assert routers and routers <= changed
    assert changed == {f"{g['producer']}.weight" for g in smoothed if g["fold"] == "norm"} | routers
    for g in smoothed:
        for r in g.get("readers", []):
            s = load_file(str(calib / awq.FILE))[f"{g['consumers'][0]}.awq_scales"]
            assert torch.equal(ck.model.get(f"{r}.weight"), (src[f"{r}.weight"].float() * s[None, :]).to(torch.bfloat16))
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {n[: -len(".weight")] for n in routers} <= set(cfg["ignore"])
    packed = read_checkpoint(out)
    for grp in ck.groups:
        members = grp["members"]
        alpha = None
        if fmt == "nvfp4":
            alpha = nvfp4.global_scale(torch.stack([want[f"{m}.weight"].float().abs().amax() for m in members]).max())
        for m in members:
            p = packed[m]
            ref = formats.quantize(want[f"{m}.weight"], fmt, alpha=alpha, backend="reference")
            assert torch.equal(p.base.codes, ref.codes) and torch.equal(bits(p.base.scales), bits(ref.scales)), m
            if fmt == "nvfp4":
                assert torch.equal(bits(p.base.global_scale), bits(alpha)), m
    assert any(".experts." in m for m in packed)
    prov = ck.resserve["provenance"]["weight_algo"]
    assert prov["name"] == "awq" and prov["scales_sha256"] == awq.file_digest(calib / awq.FILE)


# ----------------------------------------------------------------------------- verify


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_reproduces_the_smoothed_quantization(moe, arch, tmp_path):
    model, calib = moe["models"][arch], _awq(moe, arch)
    out = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    rep = verify(out, str(model), text=str(moe["texts"]), samples=2, seq_len=32, calib=calib, device="cpu")
    assert rep["weights_match_reference"] is True and rep["weight_algo"] == "awq"
    # the reference is the original product: a wrongly smoothed input or row would show as NMSE near 1
    assert max(r["plain"] for r in rep["layers"]) < 0.2
    assert any(r["module"].endswith(".down_proj") or r["module"].endswith(".w2") for r in rep["layers"] if ".experts." in r["module"])
    pooled = rep["nmse"]["pooled"]
    assert pooled["full"] < pooled["plain"]
    ppl = rep["perplexity"]
    assert ppl["plain"] < 1.5 * ppl["bf16"]  # the emulated model routes with its smoothed routers


def test_verify_catches_a_router_that_is_not_the_smoothed_one(moe, tmp_path):
    """Mixtral (router on disk under block_sparse_moe, loaded under mlp): the stored router is
    checked too; the unsmoothed one is a mismatch naming it."""
    model, calib = moe["models"]["mixtral"], _awq(moe, "mixtral")
    out = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.0, progress=False).out
    shard = next(out.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.1.block_sparse_moe.gate.weight"
    assert not torch.equal(tensors[name], source_tensors(model)[name])
    tensors[name] = source_tensors(model)[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match="block_sparse_moe.gate"):
        verify(out, str(model), text=str(moe["texts"]), samples=2, seq_len=32, calib=calib, device="cpu")


def test_scales_for_a_router_the_model_lacks_are_refused(moe, tmp_path):
    """A calibration whose MoE fold names a router this model does not have is refused by pack in
    one line, before anything is written."""
    from resserve_export.core.errors import UserError

    model, calib = moe["models"]["qwen2_moe"], _awq(moe, "qwen2_moe")
    bad = tmp_path / "calib"
    shutil.copytree(calib, bad)
    meta = _meta(bad)
    g = next(g for g in meta["weight_algo"]["groups"] if g.get("readers") and g["alpha"] is not None)
    g["readers"] = ["model.layers.7.mlp.gate"]
    (bad / "calibration.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="do not fit model.layers.7.mlp.gate of this model"):
        pack(model, bad, tmp_path / "out", "nvfp4", ratio=0.0, progress=False)
    assert not (tmp_path / "out").exists()
