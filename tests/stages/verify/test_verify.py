"""`verify`: NMSE bookkeeping against the emulated linear, the published direction (full < plain,
NMSE falling with the ratio) on synthetic and on real SmolLM2 inputs, the whole run on a tiny
packed model, and one-line errors from the CLI."""

from __future__ import annotations

import pytest
import torch

from resserve_export.algorithms import kernel
from resserve_export.algorithms.emulate import QuantizedWeight, quantized_matmul
from resserve_export.algorithms.kext import ext_width, extend_weight
from resserve_export.algorithms.selection import mode_of, select_mask
from resserve_export.cli import main
from resserve_export.formats.nvfp4 import global_scale
from resserve_export.formats.ops import quantize
from resserve_export.modeling import modelio
from resserve_export.stages.verify.measure import evaluate
from resserve_export.stages.verify.nmse import group_nmse
from resserve_export.stages.verify.report import write_chart
from resserve_export.observers import capture
from resserve_export.stages.pack.run import pack
from resserve_export.stages.verify import run as verify
from resserve_export.storage.checkpoint import Checkpoint, PackedLinear

from tests.fixtures.tiny import make_calibration, make_model


def heavy_tailed(T: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """Activations whose channels have very different scales (as LLM inputs do)."""
    scale = torch.exp(torch.randn(K, generator=gen) * 1.2)
    return (torch.randn(T, K, generator=gen) * scale).to(torch.bfloat16)


def packed_linear(w: torch.Tensor, fmt: str, ratio: float, mean_abs: torch.Tensor, amax_x: torch.Tensor) -> PackedLinear:
    """What `pack` stores for one linear, built in memory."""
    alpha = global_scale(w.float().abs().amax()) if fmt == "nvfp4" else None
    base = quantize(w, fmt, alpha=alpha)
    mask = select_mask(mean_abs, ratio) if ratio > 0 else None
    ext = extend_weight(w, mask, ratio, fmt, alpha=base.global_scale) if ext_width(w.shape[1], ratio, fmt) else None
    K = w.shape[1]
    return PackedLinear(
        "lin", fmt, base, ext, mask, ratio, mode_of(ratio), global_scale(amax_x) if fmt == "nvfp4" else None,
        ("lin",), K, ext_width(K, ratio, fmt),
    )


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_synthetic_direction_and_agreement_with_emulate(fmt):
    gen = torch.Generator().manual_seed(3)
    K, N = 512, 96
    calib, x = heavy_tailed(1024, K, gen), heavy_tailed(512, K, gen)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(torch.bfloat16)
    mean_abs = calib.float().abs().mean(0)
    pk = packed_linear(w, fmt, 0.25, mean_abs, calib.float().abs().amax())
    accs = group_nmse(x, {"lin": w}, {"lin": pk}, fmt, "ceil", mean_abs, chunk=200)["lin"]
    nmse = {k: a.nmse for k, a in accs.items()}
    chain = [nmse["plain"], nmse[0.125], nmse[0.25], nmse[0.5], nmse["full"]]
    assert all(a > b for a, b in zip(chain, chain[1:])), chain
    assert nmse["full"] < 0.6 * nmse["plain"]
    assert nmse["checkpoint"] == nmse[0.25]  # the stored extension is the sweep's ρ=0.25
    # the same numbers as the emulated linear every other part uses
    qw = QuantizedWeight(w, fmt, ratio=0.25, mask=pk.mask, weight_alpha=pk.base.global_scale)
    y_ref = x.float() @ w.float().T
    for mode in ("plain", "k_ext", "full"):
        y = quantized_matmul(x, qw, input_alpha=pk.input_scale, mode=mode)
        want = float(((y - y_ref) ** 2).sum() / (y_ref**2).sum())
        got = nmse["checkpoint" if mode == "k_ext" else mode]
        assert got == pytest.approx(want, rel=1e-5)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    model = make_model(root / "model")
    calib = make_calibration(model, root / "calib")
    ck = root / "ck"
    pack(str(model), calib, ck, "nvfp4", ratio=0.25, device="cpu", progress=False)
    return model, calib, ck


def test_evaluate_on_a_tiny_packed_model(tiny_ckpt):
    model_dir, calib, ck_dir = tiny_ckpt
    net = modelio.load_model(model_dir)
    ck = Checkpoint(ck_dir)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # padding is never captured nor scored
    batches = [{"input_ids": ids, "attention_mask": mask}]
    from resserve_export.storage.calibration import load_stats

    sal = {m: v["mean_abs"] for m, v in load_stats(calib).items()}
    rep = evaluate(net, ck, batches, sal, device=torch.device("cpu"), max_tokens=1000)
    assert rep["weights_match_reference"] is True
    assert len(rep["layers"]) == len(ck.modules) == 2 * 7
    assert all(r["tokens"] == 24 + 20 for r in rep["layers"])
    assert rep["activation_quantization"] == "PyTorch reference (cpu)"
    pooled = rep["nmse"]["pooled"]
    assert set(pooled) == {"plain", "checkpoint", "full", "ratio_0.125", "ratio_0.25", "ratio_0.5"}
    assert 0 < pooled["full"] < pooled["plain"] < 1
    assert pooled["checkpoint"] == pooled["ratio_0.25"]
    ppl = rep["perplexity"]
    assert all(torch.isfinite(torch.tensor(v)) and v > 1 for v in ppl.values())
    assert ppl["bf16"] != ppl["plain"]
    out = ck_dir.parent / "chart.png"
    write_chart(rep, out)
    assert out.stat().st_size > 1000


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_cli_errors_are_one_line(tiny_ckpt, tmp_path, capsys):
    model_dir, _, ck = tiny_ckpt
    with pytest.raises(SystemExit) as e:
        main(["verify", str(tmp_path / "nothing"), "--model", str(model_dir)])
    assert e.value.code == 2
    assert "is not a checkpoint directory" in one_line_error(capsys)
    other = make_model(tmp_path / "other", seed=5, intermediate_size=192)  # another architecture
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["verify", str(ck), "--model", str(other), "--out", str(tmp_path / "v")])
    assert e.value.code == 3  # the checkpoint does not match --model
    assert "packed from other weights" in one_line_error(capsys)
    assert not (tmp_path / "v").exists()
    with pytest.raises(SystemExit) as e:
        main(["verify", str(ck), "--model", str(model_dir), "--samples", "0"])
    assert "--samples must be at least 1" in one_line_error(capsys)


@pytest.mark.slow
def test_smollm2_direction_on_real_inputs():
    """Real SmolLM2 inputs (held-out plays), selection from calibration-split salience. The model
    runs in float32 (its weights are the bf16 checkpoint's values): the NMSE ordering asserted
    here is the quantizer's, and bf16 GEMMs are slow on CPUs without AVX512-BF16 or AMX."""
    from resserve_export.modeling import data
    from resserve_export.observers.stats import collect
    from resserve_export.modeling.groups import group_linears, linears_of

    model_dir = modelio.resolve_model(str(modelio.default_model()))
    net = modelio.load_model(model_dir, dtype="float32")
    tok = modelio.load_tokenizer(model_dir)
    groups = [g for g in group_linears(linears_of(net)) if g.modules[0].startswith(("model.layers.3.", "model.layers.20."))]
    cal = data.batches(data.make_samples(tok, data.load_documents("shakespeare:calib"), 8, 128, 1), 4)
    stats, _ = collect(net, cal, groups)
    ev = data.batches(data.make_samples(tok, data.load_documents("shakespeare:eval"), 4, 128, 0), 4)
    cap = capture.InputCapture(net, [g.modules for g in groups], 512)
    with torch.inference_mode():
        for b in ev:
            cap.set_mask(b["attention_mask"])
            net(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    cap.remove()
    mods = dict(net.named_modules())
    for fmt in ("nvfp4", "mxfp4"):
        err = {}
        for g in groups:
            ma = stats[g.modules[0]]["mean_abs"]
            weights = {m: mods[m].weight.detach() for m in g.modules}
            packed = {m: packed_linear(weights[m], fmt, 0.25, ma, stats[m]["amax"]) for m in g.modules}
            for m, accs in group_nmse(cap.inputs(g.modules), weights, packed, fmt, "ceil", ma).items():
                for k, a in accs.items():
                    e = err.setdefault(k, [0.0, 0.0])
                    e[0], e[1] = e[0] + a.err, e[1] + a.ref
        nmse = {k: e[0] / e[1] for k, e in err.items()}
        chain = [nmse["plain"], nmse[0.125], nmse[0.25], nmse[0.5], nmse["full"]]
        assert all(a > b for a, b in zip(chain, chain[1:])), (fmt, chain)
        assert nmse["full"] < 0.9 * nmse["plain"], (fmt, nmse)


@pytest.mark.gpu
@pytest.mark.skipif(not kernel.KERNEL_AVAILABLE, reason=f"needs a CUDA GPU and nvcc for the fused kernel: {kernel.KERNEL_UNAVAILABLE_REASON}")
def test_gpu_run_uses_the_kernel_and_agrees_with_cpu(tiny_ckpt):
    from resserve_export.storage.calibration import load_stats

    model_dir, calib, ck_dir = tiny_ckpt
    ck = Checkpoint(ck_dir)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    sal = {m: v["mean_abs"] for m, v in load_stats(calib).items()}
    net = modelio.load_model(model_dir).to("cuda")
    rep = evaluate(net, ck, batches, sal, device=torch.device("cuda"), check_weights=False)
    assert rep["activation_quantization"].startswith("fused CUDA kernel")
    assert 0 < rep["nmse"]["pooled"]["full"] < rep["nmse"]["pooled"]["plain"]
    # Same inputs on both devices: the kernel quantizes bit-exactly like the CPU reference, only
    # the FP32 matmul's summation order differs. (Captured model activations would differ: the
    # bf16 forward pass itself is not bit-identical between CPU and GPU.)
    gen = torch.Generator().manual_seed(3)
    x, w = heavy_tailed(300, 512, gen), (torch.randn(64, 512, generator=gen) * 0.05).to(torch.bfloat16)
    ma = x.float().abs().mean(0)
    for fmt in ("nvfp4", "mxfp4"):
        pk = packed_linear(w, fmt, 0.25, ma, x.float().abs().amax())
        got = {d: group_nmse(x.to(d), {"lin": w}, {"lin": pk}, fmt, "ceil", ma)["lin"] for d in ("cpu", "cuda")}
        for k, a in got["cpu"].items():
            assert got["cuda"][k].nmse == pytest.approx(a.nmse, rel=1e-5), (fmt, k)
