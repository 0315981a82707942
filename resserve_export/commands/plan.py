"""`resserve-export plan`: choose a prefill ratio per decision group under a bits budget (SPEC §10).

Pure optimisation over the scores stored by `calibrate --scores kl|grad`; no model is loaded.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError
from ..outputs import check_writable


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
) -> None:
    """Plan per-layer residue ratios for a budget from stored sensitivity scores."""
    from .. import plan as P
    from ..ui import console as make_console
    from resserve_export.planners import SOLVERS

    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}, available: {', '.join(SOLVERS)}")
    if solver == "highs":
        from resserve_export.planners.ilp import available

        if not available("highs"):
            raise UserError("the HiGHS solver needs the 'highspy' package: `pip install highspy`, or use --solver cbc")
    P.check_budget(budget)
    scores, calibration = P.read_scores(calib, allow_other_weights)
    chosen = P.parse_ratios(ratios, P.scored_ratios(scores))
    out = Path(out) if out is not None else Path(calib) / P.PLAN_FILE
    if out.exists() and out.is_dir():
        raise UserError(f"--out {out} is a directory: pass a file name such as {out / P.PLAN_FILE}")
    check_writable(out)
    t0 = time.perf_counter()
    plan = P.build_plan(scores, budget, ratios=chosen, solver=solver, calibration=calibration)
    solve_s = time.perf_counter() - t0
    chart_path = P.write_plan(plan, out, with_chart=chart)
    console = make_console(stderr=False, highlight=False)
    console.print(table(plan))
    n = sum(g["weight_count"] for g in plan["groups"])
    console.print(
        f"budget {plan['budget']:g} bits, achieved {plan['achieved_bits']:.4f} bits over {n:,} weights in "
        f"{len(plan['groups'])} groups; total {plan['method']} score {plan['objective']:.6g} "
        f"({solver}, {solve_s:.2f} s)"
    )
    console.print(f"wrote {out}" + (f" and {chart_path}" if chart_path else ""))


def table(plan: dict):
    """A rich table: one row per decoder layer, one column per group kind (ratio and score)."""
    from rich.table import Table

    from .. import plan as P

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
