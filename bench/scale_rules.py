"""Plain NVFP4 weights, ours against compressed-tensors' arithmetic: held-out perplexity.

llm-compressor's RTN NVFP4 (`QuantizationModifier(scheme="NVFP4")`) takes its weight scales from
compressed-tensors: `generate_gparam` for the tensor scale and `calculate_qparams` for the E4M3
block scales, from min-max observers (the tensor amax over each fused q/k/v or gate/up group).
This script applies both rules to the same weights of one model and measures the perplexity of
each, with the weights fake-quantized and everything else in float32:

- ``ours``: the rule `pack` writes (ModelOpt's: α = amax / 2688, block scale amax_block / (6·α)
  rounded once to E4M3; docs/formats.md);
- ``compressed-tensors``: `calculate_qparams` and `fake_quantize` of the installed
  compressed-tensors on the bf16 weights, as llm-compressor calls them;
- ``ours, α as compressed-tensors``: ours with the tensor scale compressed-tensors computes
  (2688 / amax, divided in bf16), to separate that difference from the block scales';
- ``ours, α × f``: ours with the tensor scale moved by a few factors, which shows how much the
  perplexity of this model moves when the same rule lands on another E4M3 grid. A difference
  between two rules that is inside this spread says nothing about the rules.

Every rule's dequantized weights are rounded to bf16 (what compressed-tensors' `fake_quantize`
returns for bf16 weights, and what an engine serving in bf16 holds), then the model runs in
float32. It also prints the mean relative difference between the two rules' dequantized weights.
Weights only: activations stay in float32 (the serving engine quantizes them at run time with
the same min-max rule in both tools).

With ``--llmcompressor-checkpoint DIR`` (a checkpoint `bench/llmcompressor_nvfp4.py` wrote from the
same model) it first checks that the ``compressed-tensors`` rule here is llm-compressor's: every
linear's dequantized weights equal after bf16 rounding; and counts how many codes, block scales
and tensor scales of that checkpoint equal ours.

GPTQ rows: ``--gptq-calib DIR`` (a ``calibrate --weight-algo gptq`` directory of the same model)
adds ours, its stored GPTQ weights; ``--checkpoint NAME=DIR`` (repeatable) adds any
compressed-tensors NVFP4 checkpoint of the same model as written, e.g. llm-compressor's GPTQ from
``bench/llmcompressor_nvfp4.py --gptq``. ``--write-ids FILE`` writes the token ids of a calibration
preset's samples (``--config``), so that llm-compressor calibrates on the very tokens ours did.

  .venv/bin/python bench/scale_rules.py [--model default] [--samples 16] [--seq-len 256] [--llmcompressor-checkpoint DIR]
      [--gptq-calib DIR] [--checkpoint NAME=DIR ...] [--write-ids FILE --config quick]
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from resserve_export.formats import nvfp4  # noqa: E402
from resserve_export.formats import ops as formats  # noqa: E402
from resserve_export.modeling import data, modelio  # noqa: E402
from resserve_export.modeling.groups import group_linears, linears_of  # noqa: E402

FACTORS = (1 + 2**-9, 1 - 2**-9, 1 + 2**-7, 1 - 2**-7, 1.02, 0.98)


def ours(ws: list[torch.Tensor], alpha: torch.Tensor | None = None) -> list[torch.Tensor]:
    if alpha is None:
        alpha = nvfp4.group_global_scale(ws)
    return [formats.dequantize(formats.quantize(w, "nvfp4", alpha=alpha)) for w in ws]


def ct_alpha(ws: list[torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' tensor scale as our α: 1 / `generate_gparam` of the group's amax."""
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    amax = torch.stack([w.abs().max() for w in ws]).max().reshape(1)
    return (1.0 / generate_gparam(-amax, amax)).reshape(()).float()


def compressed_tensors(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = NVFP4["weights"]
    amax = torch.stack([w.abs().max() for w in ws]).max().reshape(1)
    gs = generate_gparam(-amax, amax)
    out = []
    for w in ws:
        g = w.unflatten(-1, (-1, args.group_size))
        scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
        out.append(fake_quantize(w, scale, zp, args, global_scale=gs).float())
    return out


@torch.no_grad()
def perplexity(model, batches: list[dict]) -> float:
    nll, n = 0.0, 0
    for b in batches:
        logp = torch.log_softmax(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()[:, :-1], -1)
        mask = b["attention_mask"][:, 1:].bool()
        nll -= logp.gather(-1, b["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)[mask].sum().item()
        n += int(mask.sum())
    return math.exp(nll / n)


def check_llmcompressor(ckpt: Path, groups: list, source: dict) -> None:
    from safetensors.torch import load_file

    lc: dict = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        lc.update(load_file(f))
    equal, codes, scales, tensor = 0, [], [], []
    for g in groups:
        ws = [source[n] for n in g]
        alpha = nvfp4.group_global_scale(ws)
        for n, w, c in zip(g, ws, compressed_tensors(ws)):
            packed, s, gs = lc[f"{n}.weight_packed"], lc[f"{n}.weight_scale"], lc[f"{n}.weight_global_scale"].float().reshape(())
            deq = nvfp4.dequantize_blocks(packed.reshape(-1, 8), s.reshape(-1), 1 / gs).reshape(w.shape)
            equal += int(torch.equal(deq.to(torch.bfloat16), c.to(torch.bfloat16)))
            q = formats.quantize(w, "nvfp4", alpha=alpha)
            codes.append((q.codes == packed).float().mean().item())
            scales.append((q.scales.view(torch.uint8) == s.view(torch.uint8)).float().mean().item())
            tensor.append(abs(float(1 / gs) / float(alpha) - 1))
    n = len(codes)
    print(f"llm-compressor checkpoint {ckpt.name}: {equal}/{n} linears equal the compressed-tensors rule here (dequantized, bf16)")
    print(f"  against ours: code bytes equal {sum(codes) / n:.4f}, block scales equal {sum(scales) / n:.4f}, "
          f"tensor scale relative difference {sum(tensor) / n:.5f} mean, {max(tensor):.5f} max\n")


def read_compressed(ckpt: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The dequantized FP32 weights of `names` in a compressed-tensors NVFP4 checkpoint."""
    from safetensors.torch import load_file

    lc: dict = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        lc.update(load_file(f))
    out = {}
    for n in names:
        packed, s, gs = lc[f"{n}.weight_packed"], lc[f"{n}.weight_scale"], lc[f"{n}.weight_global_scale"].float().reshape(())
        out[n] = nvfp4.dequantize_blocks(packed.reshape(-1, 8), s.reshape(-1), 1 / gs).reshape(packed.shape[0], -1)
    return out


def write_ids(model_dir: Path, config: str, path: Path) -> None:
    """The token ids (valid tokens only) of calibration preset `config`'s samples, as JSON."""
    import json

    from resserve_export.stages.calibrate.config import make_config

    cfg = make_config(config)
    tok = modelio.load_tokenizer(model_dir)
    samples = data.make_samples(tok, data.load_documents(cfg.dataset), cfg.num_samples, cfg.seq_len, cfg.seed)
    batches = data.batches(samples, cfg.batch_size, data.pad_id(tok))
    ids = [row[m.bool()].tolist() for b in batches for row, m in zip(b["input_ids"], b["attention_mask"])]
    path.write_text(json.dumps(ids))
    print(f"wrote {len(ids)} calibration samples ({sum(map(len, ids))} tokens) of preset {config} to {path}")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="model path or 'default' (SmolLM2-135M-Instruct)")
    ap.add_argument("--samples", type=int, default=16, help="held-out sequences (the plays' eval split)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--llmcompressor-checkpoint", type=Path, help="llm-compressor's RTN NVFP4 checkpoint of the same model")
    ap.add_argument("--gptq-calib", type=Path, help="a calibrate --weight-algo gptq directory of the same model (NVFP4)")
    ap.add_argument("--checkpoint", action="append", default=[], help="NAME=DIR: a compressed-tensors NVFP4 checkpoint of the same model")
    ap.add_argument("--write-ids", type=Path, help="write the calibration preset's token ids here and stop")
    ap.add_argument("--config", default="quick", help="the calibration preset of --write-ids")
    a = ap.parse_args()

    md = modelio.resolve_model(a.model)
    if a.write_ids:
        write_ids(md, a.config, a.write_ids)
        return
    model = modelio.load_model(md, dtype="bfloat16")
    tok = modelio.load_tokenizer(md)
    held = data.make_samples(tok, data.load_documents("shakespeare:eval"), a.samples, a.seq_len, 7)
    batches = data.batches(held, 8, data.pad_id(tok))
    mods = dict(model.named_modules())
    groups = [g.modules for g in group_linears(linears_of(model))]
    source = {n: mods[n].weight.detach().clone() for g in groups for n in g}  # bf16, as on disk
    if a.llmcompressor_checkpoint:
        check_llmcompressor(a.llmcompressor_checkpoint, groups, source)
    model.float()

    def run(rule) -> float:
        for g in groups:
            for n, q in zip(g, rule([source[n] for n in g])):
                mods[n].weight.data = q.to(torch.bfloat16).float()
        return perplexity(model, batches)

    rows: list[tuple[str, float]] = []
    for n in source:
        mods[n].weight.data = source[n].float()
    rows.append(("source weights (bf16)", perplexity(model, batches)))
    rows.append(("ours (ModelOpt's rule)", run(ours)))
    rows.append(("compressed-tensors (llm-compressor RTN)", run(compressed_tensors)))
    rows.append(("ours, α as compressed-tensors", run(lambda ws: ours(ws, ct_alpha(ws)))))
    for f in FACTORS:
        rows.append((f"ours, α × {f:.6g}", run(lambda ws, f=f: ours(ws, nvfp4.group_global_scale(ws) * f))))
    fixed: list[tuple[str, dict]] = []
    if a.gptq_calib:
        import json

        from resserve_export.algorithms import gptq

        stored = gptq.from_calibration(a.gptq_calib, json.loads((a.gptq_calib / "calibration.json").read_text()))
        fixed.append((f"ours, GPTQ ({a.gptq_calib.name})", {n: stored.get(n).dequantize() for n in source}))
    for spec in a.checkpoint:
        name, _, path = spec.partition("=")
        fixed.append((name, read_compressed(Path(path), list(source))))
    for name, weights in fixed:  # weights as stored, rounded to bf16 like every rule's above
        for n, w in weights.items():
            mods[n].weight.data = w.to(torch.bfloat16).float()
        rows.append((name, perplexity(model, batches)))

    diffs = []
    for g in groups:
        ws = [source[n] for n in g]
        for x, y in zip(ours(ws), compressed_tensors(ws)):
            diffs.append(float((x - y).norm() / x.norm()))

    spread = [p for name, p in rows if "×" in name]
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit()}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, model {md.name}, {a.samples} x {a.seq_len} held-out tokens, weights fake-quantized, the rest float32\n")
    print("| weights | perplexity |\n| --- | ---: |")
    for name, p in rows:
        print(f"| {name} | {p:.3f} |")
    print(f"\nα moved by 0.2–2 %: perplexity {min(spread):.3f} – {max(spread):.3f}")
    print(f"ours vs compressed-tensors, dequantized weights: relative difference {sum(diffs) / len(diffs):.4f} mean, {max(diffs):.4f} max over {len(diffs)} linears")


if __name__ == "__main__":
    main()
