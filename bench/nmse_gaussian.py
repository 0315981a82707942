"""Quantization NMSE of NVFP4 and MXFP4 on Gaussian data, and what residue compensation recovers.

For X, W ~ N(0, 1) (activations [M, K], weights [N, K]) prints a Markdown table of

  NMSE = Σ‖y − y_ref‖² / Σ‖y_ref‖²   (docs/formats.md, "Verification metrics")

for: the weight QDQ; the activation QDQ plain, with residue compensation of a fraction ρ of the
channels (K-Ext, channels chosen by mean |x| as in calibration) and with full compensation
(X̂ + R̂); and the linear output X Wᵀ with both operands in FP4 (W4A4), plain vs full compensation,
against the FP32 product of the unquantized operands. NVFP4 activations use a static α from the
tensor's amax (as calibration would give); MXFP4 uses the default `ceil` scale rounding.

  .venv/bin/python bench/nmse_gaussian.py [--m 1024] [--n 2048] [--k 4096] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from resserve_export.formats import ops as formats
from resserve_export.formats import nvfp4  # noqa: E402
from resserve_export.algorithms.kext import full_residue, residue  # noqa: E402
from resserve_export.algorithms.selection import mask_to_indices, select_mask  # noqa: E402


def nmse(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return float(((y - ref) ** 2).sum() / (ref**2).sum())


def partial(x: torch.Tensor, fmt: str, alpha, ratio: float) -> torch.Tensor:
    """X̂ plus the quantized residue of the selected channels, scattered back (the K-Ext sum)."""
    base = formats.quantize(x, fmt, alpha=alpha)
    S = mask_to_indices(select_mask(x.abs().mean(0), ratio))
    r = residue(x, base)[:, S]
    r_hat = formats.qdq(r, fmt, alpha=base.global_scale)  # |S| = ρK is a multiple of the block
    out = formats.dequantize(base)
    out[:, S] += r_hat
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=1024, help="activation rows (tokens)")
    ap.add_argument("--n", type=int, default=2048, help="weight rows (out_features)")
    ap.add_argument("--k", type=int, default=4096, help="in_features")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.m, args.k, generator=g)
    w = torch.randn(args.n, args.k, generator=g)
    y_ref = x @ w.T

    print(f"# Gaussian X [{args.m}, {args.k}], W [{args.n}, {args.k}], N(0, 1) FP32, seed {args.seed}")
    print()
    print("| format | weight QDQ | act. plain | act. ρ=0.125 | act. ρ=0.25 | act. ρ=0.5 | act. full | "
          "full vs plain (act.) | W4A4 out plain | W4A4 out full | full vs plain (out) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for fmt in ("nvfp4", "mxfp4"):
        alpha = nvfp4.global_scale(x.abs().amax()) if fmt == "nvfp4" else None
        w_hat = formats.qdq(w, fmt)
        base, res = full_residue(x, fmt, alpha=alpha)
        x_hat = formats.dequantize(base)
        x_full = x_hat + formats.dequantize(res)
        parts = [nmse(partial(x, fmt, alpha, r), x) for r in (0.125, 0.25, 0.5)]
        a_plain, a_full = nmse(x_hat, x), nmse(x_full, x)
        o_plain, o_full = nmse(x_hat @ w_hat.T, y_ref), nmse(x_full @ w_hat.T, y_ref)
        cells = [nmse(w_hat, w), a_plain, *parts, a_full]
        print(
            f"| {fmt} | " + " | ".join(f"{v:.3e}" for v in cells)
            + f" | −{1 - a_full / a_plain:.1%} | {o_plain:.3e} | {o_full:.3e} | −{1 - o_full / o_plain:.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
