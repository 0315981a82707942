"""Benchmark the FP4 weight quantizer against ModelOpt 0.47 on one CPU tensor.

Quantizes a bf16 [12288, 4096] tensor (Qwen3-8B's MLP shape) to NVFP4 and MXFP4 with our
`formats.quantize` (auto backend: the torch.compile'd chunked path on CPU) and with ModelOpt's
``NVFP4QTensor.quantize`` / ``MXFP4QTensor.quantize`` in the same process, then prints a Markdown
table of GB/s of bf16 input (best of N warm runs) and the ratio ours / ModelOpt. Compile time of
our path is reported separately (first call minus the best warm run). Before timing, the NVFP4
results are checked bit for bit against ModelOpt (codes, block scales, α) and the MXFP4 block
exponents for equality (ModelOpt's element rounding differs at ties, see docs/formats.md, "MXFP4").

  .venv/bin/python bench/quantize.py [--rows 12288] [--cols 4096] [--repeats 5] [--modelopt-repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from resserve_export.formats import ops as formats  # noqa: E402


def _best(fn, n: int) -> tuple[float, float]:
    """Best wall-clock and best process CPU seconds over n runs (CPU time is what the code costs
    when other jobs share the cores; wall time is what a user waits)."""
    wall = cpu = float("inf")
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - t)
        cpu = min(cpu, time.process_time() - c)
    return wall, cpu


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        core = [f"resserve_export/{m}.py" for m in ("constants", "fp4", "nvfp4", "mxfp4", "formats", "qtensor")]
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", *core, "bench/quantize.py"],
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5, help="warm runs of ours (best is reported)")
    ap.add_argument("--modelopt-repeats", type=int, default=3, help="runs of ModelOpt (best is reported)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both sides (default 1: on a shared, loaded machine two OpenMP threads "
        "spin at barriers while descheduled and the timings say more about the load than the code)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
    from modelopt.torch.quantization.qtensor import MXFP4QTensor, NVFP4QTensor

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.rows, args.cols, generator=g).bfloat16()
    gb = x.numel() * x.element_size() / 1e9
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {_commit()}, "
        f"torch {torch.__version__}, {args.threads} threads, {platform.processor() or platform.machine()}",
        flush=True,
    )
    print(f"# input bf16 [{args.rows}, {args.cols}] = {gb:.3f} GB; ours best of {args.repeats} warm runs, "
          f"ModelOpt best of {args.modelopt_repeats}", flush=True)

    rows = []
    for fmt in ("nvfp4", "mxfp4"):
        t = time.perf_counter()
        ours_q = formats.quantize(x, fmt)
        first = time.perf_counter() - t
        ours_t, ours_c = _best(lambda: formats.quantize(x, fmt), args.repeats)

        if fmt == "nvfp4":
            ref = NVFP4QTensor.quantize(x, 16)
            same = (
                torch.equal(ours_q.codes, ref[0]._quantized_data)
                and torch.equal(ours_q.scales.view(torch.uint8), ref[1].view(torch.uint8))
                and torch.equal(ours_q.global_scale.view(torch.int32), ref[2].float().reshape(()).view(torch.int32))
            )
            check = "bit-identical (codes, scales, α)" if same else "MISMATCH"
            mo_t, mo_c = _best(lambda: NVFP4QTensor.quantize(x, 16), args.modelopt_repeats)
        else:
            ref = MXFP4QTensor.quantize(x, 32)
            same = torch.equal(ours_q.scales.reshape(-1), ref[1].reshape(-1))
            differ = (ours_q.codes != ref[0]._quantized_data).float().mean().item()
            check = f"scales identical; {differ:.2%} code bytes differ (ties, -0)" if same else "SCALE MISMATCH"
            mo_t, mo_c = _best(lambda: MXFP4QTensor.quantize(x, 32), args.modelopt_repeats)
        del ref
        rows.append((fmt, gb / ours_t, gb / mo_t, mo_t / ours_t, gb / ours_c, gb / mo_c, mo_c / ours_c,
                     max(first - ours_t, 0.0), check))
        print(f"{fmt}: ours {gb / ours_t:.3f} GB/s, ModelOpt {gb / mo_t:.3f} GB/s", flush=True)
        if not same:
            sys.exit(f"error: {fmt} result differs from ModelOpt beyond the documented tie rule")

    print()
    print("GB/s of bf16 input by wall-clock time, and by process CPU time (robust to other load)")
    print()
    print("| format | ours GB/s | ModelOpt GB/s | ours / ModelOpt | ours GB/s (CPU) | ModelOpt GB/s (CPU) "
          "| ours / ModelOpt (CPU) | compile s | check vs ModelOpt |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for fmt, o, m, r, oc, mc, rc, c, check in rows:
        print(f"| {fmt} | {o:.3f} | {m:.3f} | {r:.1f}x | {oc:.3f} | {mc:.3f} | {rc:.1f}x | {c:.1f} | {check} |")


if __name__ == "__main__":
    main()
