"""AWQ and GPTQ with residue compensation: what `verify` reports for round-to-nearest, AWQ, GPTQ and
AWQ+GPTQ checkpoints, plain and planned, and (``--part modelopt``, CUDA) ModelOpt's NVFP4 AWQ as
the anchor.

``--part table`` (default): calibrates MODEL once per ``--algos`` (default ``rtn,awq``; any of
rtn, awq, gptq, awq+gptq) on the same calibration tokens (grad scores; ``--dtype`` the model's
calibration dtype, e.g. float32 on a CPU without bf16 arithmetic), plans each at ``--budgets``
(default 4.5 / 5.0 / 5.5 bits), packs NVFP4
checkpoints (plain and planned) and measures each with `verify` on held-out text (a different
split from calibration: nothing is tuned on it). Prints a Markdown table: pooled linear-output
NMSE and perplexity of each checkpoint, with the bf16 model's perplexity.

``--part modelopt`` (CUDA): ModelOpt's ``NVFP4_AWQ_LITE_CFG`` (``mtq.quantize`` with a forward
loop over the same calibration tokens) against ``calibrate --weight-algo awq --scores none`` +
``pack --ratio 0``; held-out perplexity of ModelOpt's fake-quantized model and of our checkpoint
(as `verify` emulates it: W4A4 NVFP4, static input scales), and both calibration times.

  .venv/bin/python bench/awq.py [--model default] [--config quick] [--samples 16] [--seq-len 256] [--algos rtn,gptq] [--budgets 5.0]
  python bench/awq.py --part modelopt [--model default] [--config quick]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from resserve_export import api
from resserve_export.modeling import modelio
from resserve_export.stages.verify.run import DEFAULT_TEXT

BUDGETS = (4.5, 5.0, 5.5)


def table(args) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-awq-"))
    rows, bf16 = [], None
    extra = {"dtype": args.dtype} if args.dtype else {}
    for algo in args.algos.split(","):
        t0 = time.perf_counter()
        calib = api.calibrate(args.model, root / f"calib-{algo}", config=args.config, weight_algo=algo, progress=False, **extra).path
        t_cal = time.perf_counter() - t0
        runs = [("plain", None)] + [(f"plan {b}", b) for b in (float(x) for x in args.budgets.split(","))]
        for label, budget in runs:
            if budget is None:
                ck = api.pack(args.model, calib, root / f"ck-{algo}-plain", "nvfp4", ratio=0.0, progress=False).out
            else:
                plan = api.plan(calib, budget, out=root / f"plan-{algo}-{budget}.json", chart=False).path
                ck = api.pack(args.model, calib, root / f"ck-{algo}-{budget}", "nvfp4", plan=plan, progress=False).out
            rep = api.verify(ck, args.model, calib=calib, samples=args.samples, seq_len=args.seq_len).report
            bf16 = rep["perplexity"]["bf16"]
            rows.append((algo.upper(), label, rep["nmse"]["pooled"]["checkpoint"], rep["perplexity"]["checkpoint"], t_cal))
            print(f"  {algo} {label}: NMSE {rows[-1][2]:.4e} ppl {rows[-1][3]:.3f}", flush=True)
    print(
        f"\n{modelio.model_label(args.model)}, NVFP4 W4A4, calibration `--config {args.config}`, "
        f"{args.samples} x {args.seq_len} held-out tokens ({DEFAULT_TEXT}); bf16 perplexity {bf16:.3f}\n"
    )
    print("| weights | compensation | pooled NMSE | perplexity | calibrate (s) |")
    print("|---|---|---:|---:|---:|")
    for algo, label, nmse, ppl, t_cal in rows:
        print(f"| {algo} | {label} | {nmse:.4e} | {ppl:.3f} | {t_cal:.0f} |")


def modelopt(args) -> None:
    import modelopt.torch.quantization as mtq

    from resserve_export.modeling import data
    from resserve_export.stages.calibrate.config import make_config
    from resserve_export.stages.verify.perplexity import forward_nll

    dev = torch.device("cuda")
    cfg = make_config(args.config, device="cuda", scores="none")
    model_dir = modelio.resolve_model(args.model)
    tok = modelio.load_tokenizer(model_dir)
    samples = data.make_samples(tok, data.load_documents(cfg.dataset), cfg.num_samples, cfg.seq_len, cfg.seed)
    calib_batches = data.batches(samples, cfg.batch_size, data.pad_id(tok))
    eval_docs = data.load_documents(DEFAULT_TEXT)
    eval_batches = data.batches(data.make_samples(tok, eval_docs, args.samples, args.seq_len, 0), 4, data.pad_id(tok))

    # Ours: calibrate (AWQ search + statistics) on the GPU, pack at ratio 0, verify's emulation.
    root = Path(tempfile.mkdtemp(prefix="bench-awq-mo-"))
    ours = {}
    for algo in ("rtn", "awq"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        calib = api.calibrate(args.model, root / f"calib-{algo}", config=args.config, device="cuda", scores="none", weight_algo=algo, progress=False).path
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        ck = api.pack(args.model, calib, root / f"ck-{algo}", "nvfp4", ratio=0.0, progress=False).out
        rep = api.verify(ck, args.model, calib=calib, samples=args.samples, seq_len=args.seq_len, device="cuda").report
        ours[algo] = (t, rep["perplexity"]["checkpoint"], rep["perplexity"]["bf16"])

    # ModelOpt: the same model (bf16, on the GPU), the same calibration tokens.
    mo = {}
    for name, qcfg in (("NVFP4_DEFAULT_CFG", mtq.NVFP4_DEFAULT_CFG), ("NVFP4_AWQ_LITE_CFG", mtq.NVFP4_AWQ_LITE_CFG)):
        net = modelio.load_model(model_dir, "bfloat16").to(dev).eval()

        def loop(m):
            with torch.no_grad():
                for b in calib_batches:
                    m(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev), use_cache=False)

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mtq.quantize(net, qcfg, forward_loop=loop)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        mo[name] = (t, forward_nll(net, eval_batches, dev))
        del net
        torch.cuda.empty_cache()

    print(
        f"\n{modelio.model_label(args.model)} on {torch.cuda.get_device_name()}: calibration `--config {args.config}` "
        f"({cfg.num_samples} x {cfg.seq_len}), held-out {args.samples} x {args.seq_len} tokens ({DEFAULT_TEXT}); "
        f"bf16 perplexity {ours['awq'][2]:.3f}\n"
    )
    print("| method | calibration (s) | perplexity W4A4 NVFP4 |")
    print("|---|---:|---:|")
    print(f"| ModelOpt NVFP4_DEFAULT_CFG (max calibration) | {mo['NVFP4_DEFAULT_CFG'][0]:.2f} | {mo['NVFP4_DEFAULT_CFG'][1]:.3f} |")
    print(f"| ModelOpt NVFP4_AWQ_LITE_CFG | {mo['NVFP4_AWQ_LITE_CFG'][0]:.2f} | {mo['NVFP4_AWQ_LITE_CFG'][1]:.3f} |")
    print(f"| resserve-export rtn, ρ = 0 | {ours['rtn'][0]:.2f} | {ours['rtn'][1]:.3f} |")
    print(f"| resserve-export awq, ρ = 0 | {ours['awq'][0]:.2f} | {ours['awq'][1]:.3f} |")
    t_mo = mo["NVFP4_AWQ_LITE_CFG"][0]
    print(
        f"\nAWQ perplexity ours / ModelOpt: {ours['awq'][1]:.3f} / {mo['NVFP4_AWQ_LITE_CFG'][1]:.3f}; "
        f"calibration time ours / ModelOpt: {ours['awq'][0] / t_mo:.2f}x (ours includes loading the model; ModelOpt's does not)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("table", "modelopt"), default="table")
    ap.add_argument("--model", default="default")
    ap.add_argument("--config", default="quick")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--algos", default="rtn,awq", help="weight algorithms of the table, comma-separated")
    ap.add_argument("--budgets", default=",".join(str(b) for b in BUDGETS), help="plan budgets of the table, comma-separated")
    ap.add_argument("--dtype", default=None, help="calibration dtype (default: the preset's)")
    args = ap.parse_args()
    table(args) if args.part == "table" else modelopt(args)


if __name__ == "__main__":
    main()
