"""Mixture-of-experts models: every expert calibrated (routed or all tokens), packed per expert in
the layouts vLLM loads, sized from its config; layouts that cannot be quantized completely are
refused up front.

Tiny random Qwen3-MoE, Mixtral and DeepSeek-V3 (MLA attention, a dense first layer, a shared
expert) are built here. Their checkpoints name experts per expert (hub style) while transformers 5
loads them as fused 3-D parameters; both layouts are exercised by every test that loads a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import bits
from fixtures.tiny import make_calibration
from safetensors import safe_open
from torch.nn import functional as F

from resserve_export.stages.calibrate import run as cal
from resserve_export.stages.calibrate.config import make_config
from resserve_export.modeling import data
from resserve_export.formats import ops as formats
from resserve_export.modeling import modelio
from resserve_export.formats import nvfp4
from resserve_export.storage.checkpoint import read_checkpoint
from resserve_export.core.errors import UserError
from resserve_export.observers.experts import ExpertCollector
from resserve_export.modeling.experts import expert_blocks, fused_modules
from resserve_export.stages.pack.run import pack
from resserve_export.algorithms.selection import mask_to_bool
from resserve_export.stages.size import estimate

from test_calibrate import add_tokenizer, varied_texts, write_jsonl
from test_exit_codes import assert_one_line_error, leftovers, run
from test_pack import _source, _topk_mask_bool, assert_loaders_decode
from test_size import _written

torch.set_num_threads(2)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512)
TOP_K = 2


def _configs():
    import transformers as T

    return {
        "qwen3_moe": T.Qwen3MoeForCausalLM(
            T.Qwen3MoeConfig(**TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=TOP_K, head_dim=16)
        ),
        "mixtral": T.MixtralForCausalLM(T.MixtralConfig(**TINY, intermediate_size=64, num_local_experts=4, num_experts_per_tok=TOP_K)),
        "deepseek_v3": T.DeepseekV3ForCausalLM(
            T.DeepseekV3Config(
                **{**TINY, "num_key_value_heads": 4}, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32,
                qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
            )
        ),
        "qwen2_moe": T.Qwen2MoeForCausalLM(
            T.Qwen2MoeConfig(**TINY, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                             num_experts_per_tok=TOP_K)
        ),
        "gpt_oss": T.GptOssForCausalLM(
            T.GptOssConfig(**TINY, intermediate_size=64, num_local_experts=4, num_experts_per_tok=TOP_K, head_dim=16,
                           layer_types=["sliding_attention", "full_attention"])
        ),
    }


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    models = {}
    for name, m in _configs().items():
        m.to(torch.bfloat16).save_pretrained(root / name)
        models[name] = add_tokenizer(root / name)
    return {"root": root, "texts": write_jsonl(root / "docs.jsonl", varied_texts(10)), "models": models, "calib": {}}


def _config(moe, mode: str):
    return make_config("quick", dataset=str(moe["texts"]), num_samples=7, seq_len=48, batch_size=3, device="cpu", scores="none", moe_calib=mode)


def _calibrated(moe, arch: str, mode: str = "routed") -> Path:
    key = (arch, mode)
    if key not in moe["calib"]:
        moe["calib"][key] = cal.calibrate(str(moe["models"][arch]), moe["root"] / f"calib-{arch}-{mode}", _config(moe, mode), show_progress=False).path
    return moe["calib"][key]


ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_parameters_are_the_checkpoint_experts(moe, arch):
    """The blocks found in the headers name the experts as the checkpoint does, and the loaded
    model's fused parameters hold exactly those weights (gate rows first), expert by expert."""
    model = moe["models"][arch]
    blocks = expert_blocks(modelio.tensor_shapes(model))
    want_leaves = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    layers = [1] if arch == "deepseek_v3" else [0, 1]  # DeepSeek's first layer is dense
    assert [b.layer for b in blocks] == layers and all(b.leaves == want_leaves for b in blocks)
    net = modelio.load_model(model)
    src = _source(model)
    for b, mod in fused_modules(net, blocks).items():
        blk = next(x for x in blocks if x.prefix == b)
        for e in range(blk.num_experts):
            I = blk.intermediate
            assert torch.equal(mod.gate_up_proj[e, :I], src[blk.module(e, "gate") + ".weight"])
            assert torch.equal(mod.gate_up_proj[e, I:], src[blk.module(e, "up") + ".weight"])
            assert torch.equal(mod.down_proj[e], src[blk.module(e, "down") + ".weight"])


def _oracle(moe, arch: str, mode: str, device: str = "cpu") -> tuple[dict, dict, int]:
    """Per-expert statistics from transformers' own experts forward (unmodified) on `device`, in
    float64: ``{module: (Σ|x|, amax, rows)}``, routed-token counts per block, and valid tokens."""
    model = moe["models"][arch]
    cfg = _config(moe, mode)
    tok = modelio.load_tokenizer(model)
    samples = data.make_samples(tok, data.load_documents(cfg.dataset), cfg.num_samples, cfg.seq_len, cfg.seed)
    batches = data.batches(samples, cfg.batch_size, data.pad_id(tok))
    net = modelio.load_model(model).to(device)  # transformers' default (grouped) experts, as calibration computes them
    blocks = expert_blocks(modelio.tensor_shapes(model))
    src = {k: v.to(device, torch.float64) for k, v in _source(model).items()}
    sums: dict = {}
    counts = {b.prefix: [0] * b.num_experts for b in blocks}
    state = {}

    def add(name, x):
        s, m, n = sums.get(name, (0.0, torch.zeros((), device=x.device), 0))
        sums[name] = (s + x.abs().sum(0), torch.maximum(m, x.abs().max() if len(x) else torch.zeros(())), n + len(x))

    def hook_for(b):
        def hook(_mod, args, kwargs):
            hs, idx = args[0].double(), args[1]
            valid = state["valid"]
            for e in range(b.num_experts):
                routed = (idx == e).any(-1) & valid
                counts[b.prefix][e] += int(routed.sum())
                rows = hs[routed] if mode == "routed" else hs[valid]
                g = rows @ src[b.module(e, "gate") + ".weight"].t()
                u = rows @ src[b.module(e, "up") + ".weight"].t()
                add(b.module(e, "gate"), rows)
                add(b.module(e, "down"), F.silu(g) * u)
        return hook

    handles = [mod.register_forward_pre_hook(hook_for(next(b for b in blocks if b.prefix == p)), with_kwargs=True)
               for p, mod in fused_modules(net, blocks).items()]
    tokens = 0
    with torch.inference_mode():
        for bt in batches:
            state["valid"] = bt["attention_mask"].reshape(-1).bool()
            tokens += int(state["valid"].sum())
            state["valid"] = state["valid"].to(device)
            net(input_ids=bt["input_ids"].to(device), attention_mask=bt["attention_mask"].to(device), use_cache=False)
    for h in handles:
        h.remove()
    return {k: (s.cpu(), m.cpu(), n) for k, (s, m, n) in sums.items()}, counts, tokens


@pytest.mark.parametrize("mode", ["routed", "all"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_expert_is_calibrated_on_its_tokens(moe, arch, mode):
    _check_expert_statistics(moe, arch, mode, _calibrated(moe, arch, mode), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (calibrate --device cuda)")
@pytest.mark.parametrize("mode", ["routed", "all"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_expert_is_calibrated_on_its_tokens_on_cuda(moe, arch, mode, tmp_path):
    """The grouped collector on the GPU (torch's grouped GEMM): the model's routing unchanged (the
    counts equal those of transformers' own forward on the same GPU), statistics as the oracle's."""
    cfg = make_config("quick", dataset=str(moe["texts"]), num_samples=7, seq_len=48, batch_size=3, device="cuda", scores="none", moe_calib=mode)
    calib = cal.calibrate(str(moe["models"][arch]), tmp_path / "calib", cfg, show_progress=False).path
    _check_expert_statistics(moe, arch, mode, calib, "cuda")


def _check_expert_statistics(moe, arch: str, mode: str, calib: Path, device: str) -> None:
    rec = json.loads((calib / "calibration.json").read_text())
    sums, counts, tokens = _oracle(moe, arch, mode, device)
    assert rec["num_tokens"] == tokens and rec["moe"]["calib"] == mode
    blocks = rec["moe"]["blocks"]
    assert {p: b["routed_tokens"] for p, b in blocks.items()} == counts
    for b in blocks.values():
        assert sum(b["routed_tokens"]) == tokens * TOP_K and b["fallback"] == []
    with safe_open(str(calib / "salience.safetensors"), "pt") as h:
        stats = {k: h.get_tensor(k) for k in h.keys()}
    blk = expert_blocks(modelio.tensor_shapes(moe["models"][arch]))
    for b in blk:
        for e in range(b.num_experts):
            g, u, d = (b.module(e, r) for r in ("gate", "up", "down"))
            s, m, n = sums[g]
            assert n == (counts[b.prefix][e] if mode == "routed" else tokens)
            # gate/up read the hidden states themselves (each batch reduced in float32, as for dense linears)
            torch.testing.assert_close(stats[f"{g}.mean_abs"].double(), s / n, rtol=1e-6, atol=0)
            assert torch.equal(stats[f"{u}.mean_abs"], stats[f"{g}.mean_abs"])
            assert torch.equal(stats[f"{g}.amax"], m.float()) and torch.equal(stats[f"{u}.amax"], m.float())
            # down reads act(gate)·up, which the model computes in bf16 and the oracle in float64
            s, m, n = sums[d]
            torch.testing.assert_close(stats[f"{d}.mean_abs"].double(), s / n, rtol=2e-2, atol=1e-3)
            torch.testing.assert_close(stats[f"{d}.amax"].double(), m, rtol=2e-2, atol=1e-3)
    # every quantized linear has statistics, and the groups are per expert: gate+up, down
    groups = [tuple(g) for g in rec["groups"]]
    for b in blk:
        for e in range(b.num_experts):
            assert (b.module(e, "gate"), b.module(e, "up")) in groups and (b.module(e, "down"),) in groups
    assert all(f"{m}.mean_abs" in stats for g in groups for m in g)


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_collector_keeps_the_models_output(moe, arch, device):
    """With the hooks installed the model computes what transformers' default experts compute."""
    model = moe["models"][arch]
    net = modelio.load_model(model).to(device)
    assert net.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    with torch.inference_mode():
        ref = net(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with ExpertCollector(net, expert_blocks(modelio.tensor_shapes(model)), "all") as ec:
            ec.set_mask(mask)
            got = net(input_ids=ids, attention_mask=mask, use_cache=False).logits
            ec.end_batch()
        again = net(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(got, ref) and torch.equal(again, ref)


@pytest.mark.parametrize("mode", ["routed", "all"])
def test_non_finite_expert_activations_name_the_first_block_that_saw_them(moe, mode):
    """An overflowing expert (its gate/up weights +inf) makes the down inputs of its block
    non-finite: end_batch names that block, not the finite block before it."""
    model = moe["models"]["qwen3_moe"]
    net = modelio.load_model(model)
    blocks = expert_blocks(modelio.tensor_shapes(model))
    assert [b.layer for b in blocks] == [0, 1]
    with torch.no_grad():
        fused_modules(net, blocks)[blocks[1].prefix].gate_up_proj[:] = float("inf")
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.inference_mode(), ExpertCollector(net, blocks, mode) as ec:
        ec.set_mask(mask)
        net(input_ids=ids, attention_mask=mask, use_cache=False)
        with pytest.raises(UserError, match=r"non-finite \(NaN/Inf\) activations reach the experts of model\.layers\.1\.mlp\.experts:"):
            ec.end_batch()


def test_an_expert_no_token_reached_takes_the_pooled_statistics(moe):
    model = moe["models"]["mixtral"]
    net = modelio.load_model(model)
    blocks = expert_blocks(modelio.tensor_shapes(model))
    mods = fused_modules(net, blocks)
    torch.manual_seed(1)
    hs = torch.randn(10, 64).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 2], [0, 2]] * 3 + [[2, 0]])  # expert 3 never routed
    w = torch.full((10, 2), 0.5)
    with ExpertCollector(net, blocks, "routed") as ec:
        for mod in mods.values():
            ec.set_mask(torch.ones(1, 10))
            mod(hs, idx, w)
        ec.end_batch()
    stats, rec = ec.result()
    b = blocks[0]
    assert rec["blocks"][b.prefix]["fallback"] == [3] and rec["blocks"][b.prefix]["routed_tokens"] == [7, 6, 7, 0]
    assert ec.fallbacks == [f"{blk.prefix}.3" for blk in blocks]
    x = hs.double()
    pooled = sum(x[(idx == e).any(-1)].abs().sum(0) for e in range(3)) / 20
    torch.testing.assert_close(stats[b.module(3, "gate")]["mean_abs"], pooled.float(), rtol=1e-6, atol=0)
    assert torch.equal(stats[b.module(3, "up")]["amax"], x.abs().max().float())
    assert stats[b.module(3, "down")]["amax"] == max(stats[b.module(e, "down")]["amax"] for e in range(3))
    assert not torch.equal(stats[b.module(3, "down")]["mean_abs"], stats[b.module(0, "down")]["mean_abs"])


def test_qwen2_moe_shared_expert_and_its_gate(moe, tmp_path):
    """Qwen2-MoE: the shared expert (read as [B·T, H] rows) is a dense MLP calibrated without
    padding; its sigmoid gate stays bf16 and unquantized, like the router."""
    model = moe["models"]["qwen2_moe"]
    calib = _calibrated(moe, "qwen2_moe")
    rec = json.loads((calib / "calibration.json").read_text())
    assert ["model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj"] in rec["groups"]
    assert not any("shared_expert_gate" in m for g in rec["groups"] for m in g)
    out = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["ignore"] == ["lm_head"] + [f"model.layers.{i}.mlp.{x}" for i in (0, 1) for x in ("gate", "shared_expert_gate")]
    packed = read_checkpoint(out)
    assert "model.layers.1.mlp.shared_expert.down_proj" in packed and "model.layers.1.mlp.experts.3.down_proj" in packed


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_pack_quantizes_every_expert_as_the_reference(moe, arch, fmt, tmp_path):
    model, calib = moe["models"][arch], _calibrated(moe, arch)
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=0.25, progress=False).out
    src, packed = _source(model), read_checkpoint(out)
    with safe_open(str(calib / "salience.safetensors"), "pt") as h:
        stats = {k: h.get_tensor(k) for k in h.keys()}
    shapes = modelio.tensor_shapes(model)
    blocks = expert_blocks(shapes)
    n_experts = 0
    for b in blocks:
        for e in range(b.num_experts):
            for members in ((b.module(e, "gate"), b.module(e, "up")), (b.module(e, "down"),)):
                ws = [src[f"{m}.weight"] for m in members]
                alpha = nvfp4.global_scale(torch.stack([w.abs().amax().float() for w in ws]).max()) if fmt == "nvfp4" else None
                mask = _topk_mask_bool(stats[f"{members[0]}.mean_abs"], 2)  # the expert's own salience
                for m, w in zip(members, ws):
                    p = packed[m]
                    assert p.members == members and p.ratio == 0.25
                    ref = formats.quantize(w, fmt, alpha=alpha, backend="reference")
                    assert torch.equal(p.base.codes, ref.codes) and torch.equal(bits(p.base.scales), bits(ref.scales))
                    assert torch.equal(mask_to_bool(p.mask), mask)
                    if fmt == "nvfp4":  # gate and up share weight_scale_2 (vLLM's w13) and input_scale
                        assert torch.equal(bits(p.base.global_scale), bits(alpha))
                        want = nvfp4.global_scale(stats[f"{members[0]}.amax"]).reshape(())
                        assert torch.equal(bits(p.input_scale), bits(want))
                n_experts += 1
    assert n_experts == sum(2 * b.num_experts for b in blocks)
    # routers (and DeepSeek's correction bias) are stored as they were, and named unquantized
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    routers = [b.prefix.rsplit(".", 1)[0] + ".gate" for b in blocks]
    assert cfg["ignore"] == ["lm_head", *routers]
    if fmt == "nvfp4":
        assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"] == ["lm_head", *routers]
    stored = {}
    for f in out.glob("model-*.safetensors"):
        with safe_open(str(f), "pt") as h:
            stored.update({k: h.get_tensor(k) for k in h.keys() if ".gate." in k or k.endswith(".gate.weight")})
    for r in routers:
        assert stored[f"{r}.weight"].dtype == torch.bfloat16 and torch.equal(stored[f"{r}.weight"], src[f"{r}.weight"])
    # every quantized tensor of the checkpoint is accounted for: attention and dense MLPs too
    from resserve_export.modeling.groups import group_linears, linears_from_shapes

    assert sorted(packed) == sorted(m for g in group_linears(linears_from_shapes(shapes)) for m in g.modules)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pack --device cuda)")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_pack_of_experts_writes_the_cpu_bytes(moe, fmt, tmp_path):
    model, calib = moe["models"]["deepseek_v3"], _calibrated(moe, "deepseek_v3")
    cpu = pack(model, calib, tmp_path / "cpu", fmt, ratio=0.25, progress=False).out
    gpu = pack(model, calib, tmp_path / "gpu", fmt, ratio=0.25, device="cuda", progress=False).out
    names = sorted(p.name for p in cpu.iterdir())
    assert names == sorted(p.name for p in gpu.iterdir()) and any(n.endswith(".safetensors") for n in names)
    for n in names:
        assert (cpu / n).read_bytes() == (gpu / n).read_bytes(), n


def test_loaders_decode_expert_tensors(moe, tmp_path):
    """ModelOpt's NVFP4 and compressed-tensors' MXFP4 decoders read an expert's tensors as ours."""
    model, calib = moe["models"]["qwen3_moe"], _calibrated(moe, "qwen3_moe")
    assert_loaders_decode(model, calib, tmp_path, ["model.layers.1.mlp.experts.5.up_proj", "model.layers.0.mlp.experts.2.down_proj"])


@pytest.mark.parametrize("fmt,ratio", [("nvfp4", 0.25), ("mxfp4", 0.125), ("nvfp4", 0.0)])
@pytest.mark.parametrize("arch", ARCHS)
def test_size_equals_what_pack_writes(moe, arch, fmt, ratio, tmp_path):
    from resserve_export.stages.size import shapes_from_config

    model = moe["models"][arch]
    cfg = json.loads((model / "config.json").read_text())
    assert shapes_from_config(cfg) == modelio.tensor_shapes(model)  # names, dtypes and shapes, every tensor
    calib = make_calibration(model, tmp_path / "c")
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=ratio, progress=False).out
    rep = estimate(cfg, fmt, ratio=ratio)
    got = _written(out)
    assert {k: rep.classes[k] for k in got} == got and got["quantized linears"] > 0


def test_size_refuses_gpt_oss(moe):
    cfg = json.loads((moe["models"]["gpt_oss"] / "config.json").read_text())
    with pytest.raises(UserError, match="size knows the tensor layout of"):
        estimate(cfg, "nvfp4", ratio=0.0)


def test_size_of_a_qwen3_moe_config_counts_every_expert():
    """Qwen3-30B-A3B's shape: 48 layers of 128 experts (768 wide) under NVFP4, from its config alone."""
    cfg = {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    }
    rep = estimate(cfg, "nvfp4", ratio=0.0)
    experts = 48 * 128 * 3 * 768 * 2048
    attn = 48 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048)
    # NVFP4: 4.5 bits per weight plus two FP32 scalars per linear
    assert rep.classes["quantized linears"] == (experts + attn) * 9 // 16 + 8 * 48 * (128 * 3 + 4)
    # the routers stay bf16
    assert rep.classes["norms & biases"] >= 48 * 128 * 2048 * 2


# --------------------------------------------------------------------------- refusals


def test_gpt_oss_is_refused_before_any_work(moe, tmp_path):
    model = moe["models"]["gpt_oss"]
    out = tmp_path / "calib"
    p = run("calibrate", str(model), "--out", str(out), "--config", "quick", "--device", "cpu", "--scores", "none")
    assert_one_line_error(p, 2, "model.layers.0.mlp.experts.down_proj is a 3-D tensor", "gpt-oss", "nothing was calibrated")
    assert leftovers(out) == []
    calib = make_calibration(moe["models"]["mixtral"], tmp_path / "c")
    p = run("pack", str(model), "--calib", str(calib), "--out", str(tmp_path / "ck"), "--ratio", "0", "--device", "cpu")
    assert_one_line_error(p, 2, "3-D tensor", "nothing was packed")
    assert leftovers(tmp_path / "ck") == []


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--scores", "none", "--pipeline", "sequential"], "--pipeline sequential does not run mixture-of-experts models yet"),
        (["--scores", "none", "--moe-calib", "some"], "--moe-calib must be one of all, routed"),
    ],
)
def test_calibrate_refuses_what_moe_does_not_do_yet(moe, tmp_path, extra, needle):
    out = tmp_path / "calib"
    p = run("calibrate", str(moe["models"]["qwen3_moe"]), "--out", str(out), "--config", "quick", "--device", "cpu", *extra)
    assert_one_line_error(p, 2, needle)
    assert leftovers(out) == []


def test_plan_without_scores_says_what_to_do(moe, tmp_path):
    p = run("plan", "--calib", str(_calibrated(moe, "mixtral")), "--budget", "5.0", "--out", str(tmp_path / "plan.json"))
    assert_one_line_error(p, 2, "no sensitivity scores", "--scores grad")


@pytest.fixture(scope="module")
def scored(moe) -> Path:
    """A Qwen3-MoE calibration with grad scores (experts scored as per-expert linears)."""
    cfg = make_config("quick", dataset=str(moe["texts"]), num_samples=7, seq_len=48, batch_size=3, device="cpu", scores="grad",
                          score_samples=4, moe_calib="routed")
    return cal.calibrate(str(moe["models"]["qwen3_moe"]), moe["root"] / "calib-scored", cfg, show_progress=False).path


def test_grad_scores_cover_every_expert(moe, scored):
    sc = json.loads((scored / "scores.json").read_text())
    rec = json.loads((scored / "calibration.json").read_text())
    assert [g["modules"] for g in sc["groups"]] == rec["groups"]
    blocks = expert_blocks(modelio.tensor_shapes(moe["models"]["qwen3_moe"]))
    by_head = {g["modules"][0]: g for g in sc["groups"]}
    for b in blocks:
        for e in range(b.num_experts):
            for role in ("gate", "down"):
                g = by_head[b.module(e, role)]
                s = {float(k): v for k, v in g["scores"].items()}
                assert g["weight_count"] == (2 if role == "gate" else 1) * b.hidden * b.intermediate
                # an expert's error falls as compensation rises, and full beats plain by far
                assert all(v >= 0 for v in s.values()) and s[1.0] < 0.8 * s[0.0]


def test_plan_shares_a_ratio_across_a_layers_experts_or_not(moe, scored, tmp_path):
    from resserve_export import api
    from resserve_export.modeling.experts import expert_parts

    shared = api.plan(scored, 5.0, out=tmp_path / "shared.json", chart=False).data
    per = api.plan(scored, 5.0, out=tmp_path / "per.json", chart=False, moe_ratio="per-expert").data
    assert shared["moe"]["ratio"] == "shared" and per["moe"]["ratio"] == "per-expert"
    # 2 layers x (gate/up, down) shared decisions + 2 x (q/k/v, o) dense ones
    assert shared["moe"]["decision_units"] == 8 and per["moe"]["decision_units"] == 4 + 2 * 2 * 8
    ratios = {}
    for g in shared["groups"]:
        parts = expert_parts(g["modules"][0])
        if parts:
            ratios.setdefault((parts[0], parts[2]), set()).add(g["ratio"])
    assert len(ratios) == 4 and all(len(v) == 1 for v in ratios.values())
    # per-expert choices relax the shared ones: never a worse objective, both within the budget
    assert per["objective"] <= shared["objective"] + 1e-12
    assert shared["achieved_bits"] <= 5.0 and per["achieved_bits"] <= 5.0
    # the plan packs
    ck = pack(moe["models"]["qwen3_moe"], scored, tmp_path / "ck", "nvfp4", plan=tmp_path / "per.json", progress=False).out
    got = {m: p.ratio for m, p in read_checkpoint(ck).items()}
    assert got == {m: g["ratio"] for g in per["groups"] for m in g["modules"]}


def test_token_weighted_costs():
    """--moe-cost tokens weights each expert's weights by E·tokens_e / Σ tokens."""
    from resserve_export.stages.plan import decision_units

    def grp(m, n, s):
        return {"modules": [m], "weight_count": n, "scores": {"0": s, "1": s / 2}}

    groups = [grp(f"model.layers.0.mlp.experts.{e}.down_proj", 100, 1.0 + e) for e in range(4)] + [grp("model.layers.0.self_attn.o_proj", 50, 3.0)]
    cal_rec = {"moe": {"blocks": {"model.layers.0.mlp.experts": {"routed_tokens": [10, 30, 0, 40]}}}}
    units, unit_of = decision_units(groups, "per-expert", "tokens", cal_rec)
    assert [u["weight_count"] for u in units] == [50, 150, 0, 200, 50] and unit_of == [0, 1, 2, 3, 4]
    units, unit_of = decision_units(groups, "shared", "bits", cal_rec)
    assert [u["weight_count"] for u in units] == [400, 50] and unit_of == [0, 0, 0, 0, 1]
    assert units[0]["scores"] == {"0": 10.0, "1": 5.0}
    with pytest.raises(UserError, match="routed-token counts"):
        decision_units(groups, "shared", "tokens", {})
    with pytest.raises(UserError, match="--moe-ratio must be one of"):
        decision_units(groups, "each", "bits", cal_rec)


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_verify_measures_every_expert(moe, arch, device, tmp_path):
    from resserve_export import api

    model, calib = moe["models"][arch], _calibrated(moe, arch)
    ck = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    rep = api.verify(ck, str(model), calib=calib, text=str(moe["texts"]), samples=6, seq_len=48, device=device, out=tmp_path / "v").report
    assert rep["weights_match_reference"] is True
    blocks = expert_blocks(modelio.tensor_shapes(model))
    rows = {r["module"]: r for r in rep["layers"]}
    experts = [b.module(e, r) for b in blocks for e in range(b.num_experts) for r in ("gate", "up", "down")]
    assert set(experts) <= set(rows)
    for b in blocks:
        # each expert linear measured on the valid tokens routed to it: top-k of every token
        assert sum(rows[b.module(e, "gate")]["tokens"] for e in range(b.num_experts)) == rep["tokens_scored"] * TOP_K
        for e in range(b.num_experts):
            r = rows[b.module(e, "down")]
            assert 1e-3 < r["plain"] < 1e-1 and r["full"] < r["checkpoint"] < r["plain"]
    kinds = rep["nmse"]["by_kind"]
    assert {"expert gate/up", "expert down", "attention"} <= set(kinds)
    assert all(v["full"] < v["plain"] for v in kinds.values())
    assert (tmp_path / "v" / "verify.json").exists()


def test_verify_emulates_experts_and_unfusing_keeps_the_model(moe):
    """The perplexity passes run every expert linear emulated from the checkpoint; the per-expert
    view verify mounts computes what the fused model computes."""
    from resserve_export.storage.checkpoint import Checkpoint
    from resserve_export.algorithms.emulate import EmulatedLinear
    from resserve_export.modeling.experts import unfused
    from resserve_export.stages.verify.perplexity import emulated

    model = moe["models"]["mixtral"]
    ck_dir = pack(model, _calibrated(moe, "mixtral"), moe["root"] / "ck-mixtral-verify", "nvfp4", ratio=0.25, progress=False).out
    net = modelio.load_model(model)
    net.config._experts_implementation = "eager"
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = net(input_ids=ids, use_cache=False).logits
        blocks = expert_blocks(modelio.tensor_shapes(model))
        with unfused(net, blocks):
            got = net(input_ids=ids, use_cache=False).logits
            ck = Checkpoint(ck_dir)
            with emulated(net, ck, "plain"):
                kinds = {m: type(net.get_submodule(m)) for m in ck.modules}
                emu = net(input_ids=ids, use_cache=False).logits
        after = net(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(after, ref)  # the fused experts are back
    assert set(kinds.values()) == {EmulatedLinear} and sum(".experts." in m for m in kinds) == 2 * 4 * 3
    assert not torch.allclose(emu, ref, atol=1e-3)
    assert not any("block_sparse_moe" in n for n, _ in net.named_modules())  # the holders are gone too


def test_verify_names_a_wrong_expert(moe, tmp_path):
    """A checkpoint whose one expert's weights were changed is a mismatch (exit 3) naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    model, calib = moe["models"]["qwen3_moe"], _calibrated(moe, "qwen3_moe")
    ck = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    other = tmp_path / "other"
    shutil.copytree(model, other)
    f = next(other.glob("*.safetensors"))
    t = load_file(str(f))
    name = "model.layers.1.mlp.experts.6.down_proj.weight"
    t[name] = (t[name].float() * 1.5).to(torch.bfloat16)
    save_file(t, str(f), metadata={"format": "pt"})
    p = run("verify", str(ck), "--model", str(other), "--calib", str(calib), "--out", str(tmp_path / "v"), "--device", "cpu",
            "--text", str(moe["texts"]), "--samples", "2")
    assert_one_line_error(p, 3, "other weights", "--model")  # the fingerprint tells first
    assert leftovers(tmp_path / "v") == []
    # and the bit-for-bit check names the expert
    from resserve_export.storage.checkpoint import Checkpoint
    from resserve_export.modeling.experts import unfused
    from resserve_export.stages.verify.checks import linear_weights, weight_mismatches

    net = modelio.load_model(other)
    with unfused(net, expert_blocks(modelio.tensor_shapes(other))):
        bad = weight_mismatches(Checkpoint(ck), linear_weights(net, Checkpoint(ck)))
    assert [m for m, _ in bad] == ["model.layers.1.mlp.experts.6.down_proj"]
    p = run("verify", str(ck), "--model", str(model), "--out", str(tmp_path / "v"))
    assert_one_line_error(p, 2, "pass --calib")


def test_expert_layouts_that_cannot_be_quantized_completely_are_refused():
    base = {"model.layers.0.mlp.experts.0.gate_proj.weight": ("BF16", (32, 64)), "model.layers.0.mlp.experts.0.up_proj.weight": ("BF16", (32, 64))}
    with pytest.raises(UserError, match="not gate / up / down"):
        expert_blocks(base)
    with pytest.raises(UserError, match="numbers its experts"):
        expert_blocks({**base, "model.layers.0.mlp.experts.0.down_proj.weight": ("BF16", (64, 32)),
                       "model.layers.0.mlp.experts.2.down_proj.weight": ("BF16", (64, 32))})
    with pytest.raises(UserError, match="unlike expert 0"):
        expert_blocks({**base, "model.layers.0.mlp.experts.0.down_proj.weight": ("BF16", (64, 32)),
                       **{f"model.layers.0.mlp.experts.1.{x}.weight": ("BF16", (32, 64)) for x in ("gate_proj", "up_proj", "down_proj")}})


def test_the_collector_runs_under_accelerate_offloading(moe):
    """With accelerate's offloading hooks on the model (device_map with CPU / disk offload), the
    hooks still bring the expert weights in first: the same statistics as without them, and the
    hooks are intact afterwards."""
    from accelerate import cpu_offload

    model = moe["models"]["mixtral"]
    blocks = expert_blocks(modelio.tensor_shapes(model))
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 18:] = 0

    def run(net):
        with torch.inference_mode(), ExpertCollector(net, blocks, "routed") as ec:
            ec.set_mask(mask)
            logits = net(input_ids=ids, attention_mask=mask, use_cache=False).logits
            ec.end_batch()
        return logits, ec.result()[0]

    ref_logits, ref = run(modelio.load_model(model))
    net = cpu_offload(modelio.load_model(model), execution_device=torch.device("cpu"))
    assert net.model.layers[0].mlp.experts.gate_up_proj.device.type == "meta"
    logits, got = run(net)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(got[m]["mean_abs"], ref[m]["mean_abs"]) and torch.equal(got[m]["amax"], ref[m]["amax"]) for m in ref)
    with torch.inference_mode():
        assert torch.equal(net(input_ids=ids, attention_mask=mask, use_cache=False).logits, ref_logits)


def test_gpu_segment_statistics_equal_the_cpu_reduction():
    """The GPU's segment statistics (a float64 one-hot product per chunk of rows) equal the CPU's
    per-segment reduction: the same amax, sums within float32 accumulation (run here on the CPU,
    with chunks smaller than a segment and empty and all-padding segments)."""
    from resserve_export.modeling import experts
    from resserve_export.observers import experts

    g = torch.Generator().manual_seed(3)
    lengths = [5, 0, 37, 1, 0, 64, 9]
    rows = (torch.randn(sum(lengths), 24, generator=g) * 3).to(torch.bfloat16)
    weight = (torch.rand(len(rows), generator=g) > 0.2).float()
    weight[5 + 37 : 5 + 37 + 1] = 0  # an expert whose only row is padding
    want_sum, want_max = torch.zeros(len(lengths), 24, dtype=torch.float64), torch.zeros(len(lengths))
    experts._segment_stats(rows, weight, lengths, want_sum, want_max)
    got_sum, got_max = torch.zeros_like(want_sum), torch.zeros_like(want_max)
    old = experts.STATS_ROWS
    try:
        experts.STATS_ROWS = 16
        experts._segment_stats_gemm(rows, weight, torch.tensor(lengths), got_sum, got_max)
    finally:
        experts.STATS_ROWS = old
    exact = torch.zeros_like(want_sum)
    r0 = 0
    for e, n in enumerate(lengths):
        exact[e] = (rows[r0 : r0 + n].double().abs() * weight[r0 : r0 + n, None].double()).sum(0)
        r0 += n
    assert torch.equal(got_max, want_max) and want_max[3] == 0 and want_max[1] == 0
    torch.testing.assert_close(got_sum, exact, rtol=1e-12, atol=0)
    torch.testing.assert_close(want_sum, exact, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_segment_statistics_equal_the_exact_sums():
    """The routed collector's Triton pass on CUDA: float64 sums equal the exact per-segment sums
    of the kept rows bit for bit (bf16 rows, sums exact in float64), amax and kept-row counts
    equal; empty and all-padding segments; a non-finite value in a padding row is ignored, one in
    a kept row makes the sum NaN and the amax +inf (so calibration's finiteness check fires)."""
    from resserve_export.observers import segment_stats

    if not segment_stats.available(torch.device("cuda")):
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(5)
    lengths = [5, 0, 37, 1, 0, 640, 9, 1000]
    K = 300  # not a multiple of the column block
    rows = (torch.randn(sum(lengths), K, generator=g) * 3).to(torch.bfloat16)
    keep = torch.rand(len(rows), generator=g) > 0.2
    keep[5 + 37] = False  # an expert whose only row is padding
    rows[7, 3] = float("nan")
    keep[7] = False  # NaN in a padding row: ignored
    ends = torch.tensor(lengths).cumsum(0).to(torch.int32)
    E = len(lengths)
    acc_sum = torch.full((E, K), 0.5, dtype=torch.float64)  # accumulates onto what is there
    acc_max = torch.full((E,), 0.25)
    acc_n = torch.full((E,), 2, dtype=torch.int64)
    dev = [t.cuda() for t in (acc_sum, acc_max, acc_n)]
    segment_stats.segment_stats(rows.cuda(), keep.cuda(), ends.cuda(), *dev)
    want_sum, want_max, want_n = acc_sum.clone(), acc_max.clone(), acc_n.clone()
    r0 = 0
    for e, n in enumerate(lengths):
        k = keep[r0 : r0 + n]
        a = rows[r0 : r0 + n][k].double().abs()
        want_sum[e] += a.sum(0)
        want_max[e] = max(float(want_max[e]), float(a.max()) if len(a) else 0.0)
        want_n[e] += int(k.sum())
        r0 += n
    assert torch.equal(dev[0].cpu(), want_sum) and torch.equal(dev[1].cpu(), want_max) and torch.equal(dev[2].cpu(), want_n)
    assert want_n[3] == 2 and want_max[3] == 0.25
    rows[50, 7] = float("nan")
    keep[50] = True
    s, m = torch.zeros(E, K, dtype=torch.float64, device="cuda"), torch.zeros(E, device="cuda")
    segment_stats.segment_stats(rows.cuda(), keep.cuda(), ends.cuda(), s, m)
    assert torch.isnan(s[5, 7]) and m[5] == float("inf") and torch.isfinite(m[[0, 2, 6, 7]]).all()
