"""`resserve-export plan`: choose a prefill ratio per decision group under a bits budget
(docs/formats.md, "Ratio planner").

Pure optimisation over the scores stored by `calibrate --scores kl|grad`; no model is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from resserve_export import api
from resserve_export.core.ui import console as make_console
from resserve_export.stages import plan as P


def command(
    calib: Path = typer.Option(..., "--calib", help="Calibration directory written by `calibrate --scores kl|grad`."),
    budget: float = typer.Option(
        ..., "--budget", help="Average effective bits per quantized weight, in [4, 8]: 4 plain FP4, 5.0 ≈ ratio 0.25, 8 full."
    ),
    ratios: Optional[str] = typer.Option(
        None, "--ratios", help="Comma-separated candidate ratios, a subset of the scored ones (default: all, e.g. 0,0.125,0.25,0.5,1)."
    ),
    solver: str = typer.Option("cbc", "--solver", help="cbc (exact ILP, default), highs (exact ILP, needs highspy) or greedy (baseline)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Plan file to write (default: CALIB/plan.json); the chart plan.png goes next to it."),
    chart: bool = typer.Option(True, "--chart/--no-chart", help="Write the per-layer ratio chart."),
    allow_other_weights: bool = typer.Option(
        False, "--allow-other-weights", help="plan from scores computed on other weights than the calibration's; refused by default"
    ),
    moe_ratio: str = typer.Option(
        "shared", "--moe-ratio",
        help="Mixture-of-experts models: shared (one ratio per layer and projection kind, across that layer's experts) or per-expert.",
    ),
    moe_cost: str = typer.Option(
        "bits", "--moe-cost",
        help="Mixture-of-experts models: the budget counts stored bits (bits) or bits weighted by each expert's share of "
        "the calibration's routed tokens (tokens: the decode cost).",
    ),
) -> None:
    """Plan per-layer residue ratios for a budget from stored sensitivity scores."""

    res = api.plan(
        calib, budget, ratios=ratios, solver=solver, out=out, chart=chart, allow_other_weights=allow_other_weights,
        moe_ratio=moe_ratio, moe_cost=moe_cost,
    )
    plan = res.data
    console = make_console(stderr=False, highlight=False)
    console.print(table(plan))
    n = sum(g["weight_count"] for g in plan["groups"])
    console.print(
        f"budget {plan['budget']:g} bits, achieved {plan['achieved_bits']:.4f} bits over {n:,} weights in "
        f"{len(plan['groups'])} groups; total {plan['method']} score {plan['objective']:.6g} "
        f"({solver}, {res.solve_seconds:.2f} s)"
    )
    if plan.get("moe"):
        m = plan["moe"]
        console.print(
            f"experts: {m['ratio']} ratios, budget counted in {m['cost']}; {m['decision_units']} decisions; "
            f"stored bits {m['stored_bits']:.4f}"
        )
    console.print(f"wrote {res.path}" + (f" and {res.chart}" if res.chart else ""))


def table(plan: dict):
    """A rich table: one row per decoder layer, one column per group kind (ratio and score)."""


    kinds, layers = P.by_layer(plan)
    t = Table(title=f"ratio per layer (budget {plan['budget']:g} bits, method {plan['method']})")
    t.add_column("layer", justify="right")
    for k in kinds:
        t.add_column(k, justify="right")
    t.add_column("bits", justify="right")
    for layer in sorted(layers, key=lambda x: (x is None, x if x is not None else 0)):
        row = layers[layer]
        n = sum(g["weight_count"] for g in row.values())
        bits = sum(g["weight_count"] * g["bits"] for g in row.values()) / n
        cells = [f"{row[k]['ratio']:g}  [dim]{row[k]['score']:.3g}[/dim]" if k in row else "" for k in kinds]
        t.add_row("-" if layer is None else str(layer), *cells, f"{bits:.2f}")
    return t
