"""verify's chart: per-layer linear-output NMSE of a report (nmse.png)."""

from __future__ import annotations

from pathlib import Path


def write_chart(report: dict, path: Path) -> None:
    """Per-layer NMSE (log scale) for plain, the sweep, the checkpoint and full compensation."""
    # Imported here: matplotlib.pyplot takes about 1.3 s to import (python -X importtime, after
    # torch), which every command would pay, since the CLI imports this stage at start-up.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = report["layers"]
    xs = list(range(len(layers)))
    fig, ax = plt.subplots(figsize=(max(8, len(layers) * 0.06), 4.5))
    series = [("plain", "plain W4A4")] + [(k, k.replace("ratio_", "K-Ext ρ=")) for k in report["nmse"]["sweep_keys"]]
    series += [("full", "full compensation"), ("checkpoint", "checkpoint ratios")]
    for key, label in series:
        ax.plot(xs, [r[key] for r in layers], label=label, linewidth=1, marker="." if key == "checkpoint" else None)
    ax.set_yscale("log")
    ax.set_xlabel("quantized linear (model order)")
    ax.set_ylabel("output NMSE vs FP32")
    ax.set_title(f"{Path(str(report.get('model', '')).split(' ')[0]).name} {report['format'].upper()}: per-layer linear-output NMSE")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["write_chart"]
