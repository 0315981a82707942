"""Expert statistics: every expert calibrated on its tokens (routed or all), against an independent
oracle; the collector keeps the model's output, names non-finite blocks, pools unreached experts,
runs under offloading; the segment reductions (CPU, GPU, Triton) agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.nn import functional as F

from resserve_export.core.errors import UserError
from resserve_export.modeling import data
from resserve_export.modeling import modelio
from resserve_export.modeling.experts import expert_blocks, fused_modules
from resserve_export.observers.experts import ExpertCollector
from resserve_export.stages.calibrate import run as cal
from resserve_export.stages.calibrate.config import make_config

from tests.fixtures.checkpoints import source_tensors
from tests.fixtures.moe import ARCHS, CUDA, TOP_K, calibrated, moe_config

# The session's MoE models and their cached calibrations (tests.fixtures.moe) are built once:
# under pytest-xdist (--dist loadgroup) every MoE test runs on one worker.
pytestmark = pytest.mark.xdist_group("moe")



def _oracle(moe, arch: str, mode: str, device: str = "cpu") -> tuple[dict, dict, int]:
    """Per-expert statistics from transformers' own experts forward (unmodified) on `device`, in
    float64: ``{module: (Σ|x|, amax, rows)}``, routed-token counts per block, and valid tokens."""
    model = moe["models"][arch]
    cfg = moe_config(moe, mode)
    tok = modelio.load_tokenizer(model)
    samples = data.make_samples(tok, data.load_documents(cfg.dataset), cfg.num_samples, cfg.seq_len, cfg.seed)
    batches = data.batches(samples, cfg.batch_size, data.pad_id(tok))
    net = modelio.load_model(model).to(device)  # transformers' default (grouped) experts, as calibration computes them
    blocks = expert_blocks(modelio.tensor_shapes(model))
    src = {k: v.to(device, torch.float64) for k, v in source_tensors(model).items()}
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
    _check_expert_statistics(moe, arch, mode, calibrated(moe, arch, mode), "cpu")


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


@pytest.mark.parametrize("device", ["cpu", CUDA])
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


def _triton_segments_available() -> bool:
    from resserve_export.observers import segment_stats

    return segment_stats.available(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(torch.cuda.is_available() and not _triton_segments_available(), reason="needs Triton")
def test_triton_segment_statistics_equal_the_exact_sums():
    """The routed collector's Triton pass on CUDA: float64 sums equal the exact per-segment sums
    of the kept rows bit for bit (bf16 rows, sums exact in float64), amax and kept-row counts
    equal; empty and all-padding segments; a non-finite value in a padding row is ignored, one in
    a kept row makes the sum NaN and the amax +inf (so calibration's finiteness check fires)."""
    from resserve_export.observers import segment_stats

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


SMALL, MODEL_SIZED = (7, 37, 64, 48), (16, 301, 2048, 768)  # experts, rows, hidden, intermediate


@pytest.mark.parametrize("scaled", [False, True], ids=["routed-on-output", "routed-on-input"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "device, shape",
    # The model-sized shape is for the GPU's GEMM algorithms, which depend on it.
    [
        pytest.param("cpu", SMALL, id="cpu"),
        pytest.param("cuda", SMALL, marks=CUDA.marks, id="cuda"),
        pytest.param("cuda", MODEL_SIZED, marks=CUDA.marks, id="cuda-model-sized"),
    ],
)
def test_every_expert_chunks_equal_the_per_expert_loop(device, dtype, shape, scaled):
    """``--moe-calib all``'s batched GEMMs over chunks of experts give the statistics of one GEMM
    per expert bit for bit (the loop the collector ran before), for every chunk size: one expert,
    several chunks with a remainder, all experts at once. The loop reduces as the collector
    does: in float32 by `torch.segment_reduce` on the CPU; on a GPU bf16 sums exact per exponent
    band (`banded`, computed here on the CPU by its eager reference from the GPU's act·up, while
    the collector fuses act·up into the Triton reduction), float32 ones in float64. The
    model-sized data holds very negative gates (silu ≈ 1e-20 beside values near 10), where a plain float64 sum's
    bits depend on its order. `scaled` (Llama 4): expert e reads every row times its score for
    e, rounded to the dtype as the model rounds it, and the statistics of those inputs are
    taken too."""
    from resserve_export.observers import banded
    from resserve_export.observers.experts import every_expert_stats

    g = torch.Generator().manual_seed(3)
    E, n, H, I = shape
    mod = torch.nn.Module()
    mod.gate_up_proj = torch.nn.Parameter((torch.randn(E, 2 * I, H, generator=g) / 8).to(dtype).to(device), requires_grad=False)
    mod.act_fn = F.silu
    x = (torch.randn(n, H, generator=g) * torch.rand(H, generator=g) * 4).to(dtype).to(device)

    scores = torch.rand(n, E, generator=g).to(dtype).to(device) if scaled else None

    def reduce(a):
        if device == "cpu":
            return torch.segment_reduce(a.float(), "sum", lengths=torch.tensor([n]), axis=0, initial=0)[0].double().cpu()
        if a.dtype in banded.EXACT_DTYPES:
            return banded.exact_abs_sums(a.cpu()[None])[0]
        return a.double().sum(0).cpu()

    ref_sum = torch.zeros(E, I, dtype=torch.float64)
    ref_amax = torch.zeros(E, dtype=torch.float32)
    ref_in_sum = torch.zeros(E, H, dtype=torch.float64)
    ref_in_amax = torch.zeros(E, dtype=torch.float32)
    for e in range(E):
        xe = x * scores[:, e : e + 1] if scaled else x
        gate, up = (xe @ mod.gate_up_proj[e].t()).chunk(2, dim=-1)
        a = (F.silu(gate) * up).abs()
        ref_sum[e], ref_amax[e] = reduce(a), a.amax().float().cpu()
        ref_in_sum[e], ref_in_amax[e] = reduce(xe.abs()), xe.abs().amax().float().cpu()

    per_expert = n * 2 * I * 2 * x.element_size() + (n * H * x.element_size() if scaled else 0)
    for chunk in (1, 3 * per_expert, 1 << 30):
        acc_sum = torch.zeros(E, I, dtype=torch.float64, device=device)
        acc_amax = torch.zeros(E, dtype=torch.float32, device=device)
        acc_in = (torch.zeros(E, H, dtype=torch.float64, device=device), torch.zeros(E, dtype=torch.float32, device=device))
        every_expert_stats(mod, x, acc_sum, acc_amax, chunk_bytes=chunk, scales=scores, acc_in=acc_in if scaled else None)
        assert torch.equal(acc_sum.cpu(), ref_sum), chunk
        assert torch.equal(acc_amax.cpu(), ref_amax), chunk
        if scaled:
            assert torch.equal(acc_in[0].cpu(), ref_in_sum) and torch.equal(acc_in[1].cpu(), ref_in_amax), chunk
