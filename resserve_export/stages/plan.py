"""Ratio plans (docs/formats.md, "Ratio planner"): from stored sensitivity scores to one residue ratio per decision group.

Pure functions, no model: `read_scores` / `build_plan` / `write_plan` for the `plan` command,
`load_plan` for `pack` (validates the contract and that the plan belongs to the model), and
`chart` for the per-layer picture.

Costs are exact: a group of n weights at ratio ρ costs 4·n·(1+ρ) effective bits and ρ is a
multiple of 1/8, so the solver works on the integer extra cost n·8ρ against the integer capacity
⌊2·(B−4)·Σn⌋ (B read as the decimal it was written as) and no rounding decides the budget.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

from resserve_export.core.errors import UserError
from resserve_export.core.names import layer_index, ratio_key
from resserve_export.core.outputs import write_file_atomic
from resserve_export.formats.constants import RATIOS
from resserve_export.modeling.experts import expert_parts
from resserve_export.planners import Infeasible, Problem, objective, total_cost
from resserve_export.planners import solve as solve_problem

# matplotlib.pyplot (about 1.3 s to import, python -X importtime) is imported where the chart is
# drawn: `plan --no-chart` and the commands that read plans never pay for it.

SCORES_FILE = "scores.json"
CALIBRATION_FILE = "calibration.json"
PLAN_FILE = "plan.json"
CHART_FILE = "plan.png"
MIN_BUDGET, MAX_BUDGET = 4.0, 8.0
PLAN_VERSION = 1


def bits_of(ratio: float) -> float:
    """Effective bits per weight of a group at ratio ρ: 4·(1+ρ)."""
    return 4.0 * (1.0 + ratio)


def parse_ratios(text: str | None, available: list[float]) -> list[float]:
    """``"0,0.25,1"`` -> sorted ratios, each one scored in `available`."""
    if text is None or not text.strip():
        return sorted(available)
    out = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            r = float(part)
        except ValueError:
            raise UserError(f"--ratios: {part!r} is not a number; pass a comma-separated subset of {_fmt(available)}") from None
        if r not in available:
            raise UserError(f"--ratios: ratio {part} has no stored score; choose from {_fmt(available)}")
        out.add(r)
    if not out:
        raise UserError(f"--ratios is empty; pass a comma-separated subset of {_fmt(available)}")
    return sorted(out)


def _fmt(ratios) -> str:
    return ",".join(ratio_key(r) for r in sorted(ratios))


def check_budget(budget: float) -> float:
    if not (isinstance(budget, (int, float)) and math.isfinite(budget)) or not MIN_BUDGET <= budget <= MAX_BUDGET:
        raise UserError(
            f"budget {budget} is outside [{MIN_BUDGET:g}, {MAX_BUDGET:g}] effective bits: "
            "4 is plain FP4 everywhere, 8 is full compensation everywhere (5.0 = an average ratio of 0.25)"
        )
    return float(budget)


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg}, line {e.lineno}): rerun the command that wrote the {what}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a {what} object: rerun the command that wrote it")
    return data


def read_scores(calib: Path, allow_other_weights: bool = False) -> tuple[dict, dict]:
    """(scores.json, calibration.json or {}) of a calibration directory, validated.

    Scores and salience must come from the same weights (both record the weights' fingerprint).
    """
    calib = Path(calib)
    if not calib.is_dir():
        raise UserError(f"calibration directory {calib} does not exist: run `resserve-export calibrate` first")
    path = calib / SCORES_FILE
    if not path.exists():
        raise UserError(
            f"{calib} has no sensitivity scores ({SCORES_FILE}): run `resserve-export calibrate` with `--scores kl` or `--scores grad`"
        )
    scores = _read_json(path, "scores")
    groups = scores.get("groups")
    if not isinstance(groups, list) or not groups:
        raise UserError(f"{path} lists no groups: rerun calibration with --scores kl or --scores grad")
    for i, g in enumerate(groups):
        ok = (
            isinstance(g, dict)
            and isinstance(g.get("modules"), list)
            and g["modules"]
            and isinstance(g.get("weight_count"), int)
            and g["weight_count"] > 0
            and isinstance(g.get("scores"), dict)
            and g["scores"]
        )
        if not ok:
            raise UserError(f"{path}: group {i} lacks modules, weight_count or scores: rerun calibration with --scores")
        for k, v in g["scores"].items():
            try:
                r, s = float(k), float(v)
            except (TypeError, ValueError):
                raise UserError(f"{path}: group {g['modules'][0]} has a non-numeric score entry {k!r}: {v!r}") from None
            if r not in RATIOS or not math.isfinite(s):
                raise UserError(f"{path}: group {g['modules'][0]} has an invalid score {k!r}: {v!r}; rerun calibration")
    cal_path = calib / CALIBRATION_FILE
    calibration = _read_json(cal_path, "calibration") if cal_path.exists() else {}
    ours, theirs = scores.get("fingerprint"), calibration.get("fingerprint")
    if ours and theirs and ours != theirs and not allow_other_weights:
        raise UserError(
            f"{path} was computed from other weights than {cal_path} describes (fingerprints differ): "
            "re-run calibrate, or pass --allow-other-weights to plan anyway"
        )
    return scores, calibration


def scored_ratios(scores: dict) -> list[float]:
    """Ratios scored for every group."""
    common = None
    for g in scores["groups"]:
        rs = {float(k) for k in g["scores"]}
        common = rs if common is None else common & rs
    return sorted(common or ())


def build_problem(groups: list[dict], ratios: list[float], budget: float) -> Problem:
    """Integer multiple-choice knapsack: option j of group l is ratios[j] (see the module doc)."""
    total = sum(g["weight_count"] for g in groups)
    capacity = math.floor(2 * (Fraction(repr(float(budget))) - 4) * total)
    costs, rows = [], []
    for g in groups:
        by_ratio = {float(k): float(v) for k, v in g["scores"].items()}
        rows.append(tuple(by_ratio[r] for r in ratios))
        costs.append(tuple(g["weight_count"] * round(8 * r) for r in ratios))
    return Problem(tuple(rows), tuple(costs), capacity)


MOE_RATIO = ("shared", "per-expert")
MOE_COST = ("bits", "tokens")


def decision_units(groups: list[dict], moe_ratio: str = "shared", moe_cost: str = "bits", calibration: dict | None = None) -> tuple[list[dict], list[int]]:
    """What the solver decides on, and the unit of each group.

    A dense group is its own unit. Mixture-of-experts groups: with ``moe_ratio`` ``shared`` one
    unit per (expert block, projection kind) — the gate/up groups of a layer's experts share a
    ratio, their down groups another — whose score is the sum of its groups' scores; with
    ``per-expert`` each expert group is a unit. Costs count stored weights (``moe_cost``
    ``bits``) or, with ``tokens``, weights times the expert's share of its layer's routed tokens
    (E·tokens_e / Σ tokens, from calibration.json; a decode-cost view: an expert no token reaches
    costs nothing), rounded to whole weights.
    """

    if moe_ratio not in MOE_RATIO:
        raise UserError(f"--moe-ratio must be one of {', '.join(MOE_RATIO)}, got {moe_ratio!r}")
    if moe_cost not in MOE_COST:
        raise UserError(f"--moe-cost must be one of {', '.join(MOE_COST)}, got {moe_cost!r}")
    blocks = ((calibration or {}).get("moe") or {}).get("blocks") or {}
    units: list[dict] = []
    unit_of: list[int] = []
    keyed: dict[tuple, int] = {}
    for g in groups:
        parts = expert_parts(g["modules"][0])
        cost = g["weight_count"]
        if parts is not None and moe_cost == "tokens":
            prefix, e, _ = parts
            routed = (blocks.get(prefix) or {}).get("routed_tokens")
            if not routed or sum(routed) == 0:
                raise UserError(f"--moe-cost tokens needs the routed-token counts of {prefix} in calibration.json: re-run calibrate")
            cost = round(g["weight_count"] * len(routed) * routed[e] / sum(routed))
        key = (parts[0], parts[2]) if parts is not None and moe_ratio == "shared" else None
        if key is not None and key in keyed:
            u = units[keyed[key]]
            u["weight_count"] += cost
            u["scores"] = {k: u["scores"][k] + float(v) for k, v in g["scores"].items() if k in u["scores"]}
        else:
            if key is not None:
                keyed[key] = len(units)
            units.append({"weight_count": cost, "scores": {k: float(v) for k, v in g["scores"].items()}})
        unit_of.append(keyed[key] if key is not None else len(units) - 1)
    return units, unit_of


def build_plan(
    scores: dict,
    budget: float,
    *,
    ratios: list[float] | None = None,
    solver: str = "cbc",
    calibration: dict | None = None,
    moe_ratio: str = "shared",
    moe_cost: str = "bits",
) -> dict:
    """The plan.json content for a budget: one ratio per group minimising the summed scores
    (experts' groups decided together or apart as `decision_units` says)."""

    budget = check_budget(budget)
    available = scored_ratios(scores)
    ratios = sorted(ratios) if ratios is not None else available
    missing = [r for r in ratios if r not in available]
    if missing:
        raise UserError(f"no stored score for ratio {_fmt(missing)}; scored ratios are {_fmt(available)}")
    groups = scores["groups"]
    has_experts = any(expert_parts(g["modules"][0]) is not None for g in groups)
    units, unit_of = decision_units(groups, moe_ratio, moe_cost, calibration)
    problem = build_problem(units, ratios, budget)
    total = sum(u["weight_count"] for u in units)
    cheapest = MIN_BUDGET + 4.0 * min(ratios)
    try:
        choice = solve_problem(problem, solver)
    except Infeasible:
        raise UserError(
            f"budget {budget:g} cannot be met with ratios {_fmt(ratios)}: the cheapest plan needs {cheapest:g} bits; "
            "raise --budget or include 0 in --ratios"
        ) from None
    except RuntimeError as e:
        raise UserError(f"{e}") from None
    extra = total_cost(problem, choice)
    achieved = MIN_BUDGET + extra / (2 * total)
    if extra > problem.capacity:  # the solvers check this too; a plan over budget is never written
        raise UserError(f"internal error: the {solver} plan uses {achieved} bits over the budget {budget}")
    calibration = calibration or {}
    out_groups = []
    for g, u in zip(groups, unit_of):
        j = choice[u]
        r = ratios[j]
        out_groups.append(
            {
                "modules": list(g["modules"]),
                "ratio": r,
                "score": float(g["scores"][ratio_key(r)]) if ratio_key(r) in g["scores"] else problem.scores[u][j],
                "bits": bits_of(r),
                "weight_count": g["weight_count"],
            }
        )
    moe = None
    if has_experts:
        stored = sum(g["weight_count"] * g["bits"] for g in out_groups) / sum(g["weight_count"] for g in out_groups)
        moe = {"ratio": moe_ratio, "cost": moe_cost, "decision_units": len(units), "stored_bits": stored}
    plan = {
        "version": PLAN_VERSION,
        "budget": budget,
        "achieved_bits": achieved,
        "satisfied": True,
        "method": scores.get("method", "unknown"),
        "solver": solver,
        "objective": objective(problem, choice),
        "ratios": ratios,
        "score_samples": scores.get("samples"),
        "format": scores.get("format"),
        "mx_scale_rounding": scores.get("rounding"),
        "model": calibration.get("model"),
        "fingerprint": calibration.get("fingerprint", scores.get("fingerprint")),
        "fingerprint_method": calibration.get("fingerprint_method"),
        "groups": out_groups,
    }
    if moe is not None:
        plan["moe"] = moe
    return plan


def write_plan(plan: dict, out: Path, *, with_chart: bool = True) -> Path | None:
    """Write plan.json (atomically) and, next to it, the per-layer chart. Returns the chart path."""
    out = Path(out)
    data = (json.dumps(plan, indent=2) + "\n").encode()
    chart_path = out.with_name(CHART_FILE) if out.name == PLAN_FILE else out.with_suffix(".png")
    if with_chart:
        write_file_atomic(chart_path, lambda f: chart(plan, f))
    write_file_atomic(out, lambda f: f.write(data))
    return chart_path if with_chart else None


def kind_of(modules: list[str]) -> str:
    """Short label of a group's member leaves: "q/k/v", "gate/up", "o", "down"...; a routed
    expert's groups: "experts gate/up", "experts down" (Mixtral: "experts w1/w3", "experts w2")."""

    label = "/".join(m.rsplit(".", 1)[-1].removesuffix("_proj") for m in modules)
    return f"experts {label}" if expert_parts(modules[0]) is not None else label


def by_layer(plan: dict) -> tuple[list[str], dict[int | None, dict[str, dict]]]:
    """(kinds in first-seen order, {layer: {kind: group}}) for tables and charts. A layer's
    expert groups of one kind show as one: their weight-averaged ratio and bits, summed score."""
    kinds: list[str] = []
    layers: dict[int | None, dict[str, dict]] = {}
    for g in plan["groups"]:
        k = kind_of(g["modules"])
        if k not in kinds:
            kinds.append(k)
        row = layers.setdefault(layer_index(g["modules"][0]), {})
        if k in row:
            a = row[k]
            n = a["weight_count"] + g["weight_count"]
            row[k] = {
                "modules": a["modules"] + list(g["modules"]),
                "ratio": (a["ratio"] * a["weight_count"] + g["ratio"] * g["weight_count"]) / n,
                "bits": (a["bits"] * a["weight_count"] + g["bits"] * g["weight_count"]) / n,
                "score": a["score"] + g["score"],
                "weight_count": n,
            }
        else:
            row[k] = g
    return kinds, layers


def chart(plan: dict, fileobj) -> None:
    """Per-layer ratio chart (PNG): one line per group kind across decoder layers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds, layers = by_layer(plan)
    numbered = sorted(k for k in layers if k is not None)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(numbered) + 3), 4.0), dpi=100)
    for i, kind in enumerate(kinds):
        xs = [l for l in numbered if kind in layers[l]]
        ys = [layers[l][kind]["ratio"] for l in xs]
        # Small vertical offsets keep coinciding lines apart.
        ax.plot(xs, [y + 0.012 * (i - (len(kinds) - 1) / 2) for y in ys], marker="o", ms=3, lw=1, label=kind)
    ax.set_yticks(sorted(set(plan["ratios"])))
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("prefill ratio ρ")
    ax.set_title(f"resserve plan: budget {plan['budget']:g} bits, achieved {plan['achieved_bits']:.3f} ({plan['method']})")
    ax.grid(True, alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7, ncol=max(1, min(6, len(kinds))), loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.tight_layout()
    fig.savefig(fileobj, format="png", metadata={"Software": None})
    plt.close(fig)


def load_plan(path: Path, *, modules: list[str] | None = None, check_weights=None) -> dict:
    """Read and validate a plan.json (for `pack`).

    check_weights: a function given the plan's record that raises when the plan was made from
    other weights than the model's (at once, or later when the model's fingerprint is still being
    hashed); None skips the check, as ``--allow-other-weights`` does.
    modules: the model's quantized linears; every one must get exactly one ratio from the plan.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"plan {path} does not exist: run `resserve-export plan --calib DIR --budget B` first")
    plan = _read_json(path, "plan")
    if check_weights is not None:
        check_weights(plan)
    groups = plan.get("groups")
    if not isinstance(groups, list) or not groups:
        raise UserError(f"{path} has no groups: regenerate it with `resserve-export plan`")
    seen: dict[str, float] = {}
    for g in groups:
        if not isinstance(g, dict) or not isinstance(g.get("modules"), list) or "ratio" not in g:
            raise UserError(f"{path}: every group needs modules and a ratio; regenerate it with `resserve-export plan`")
        if g["ratio"] not in RATIOS:
            raise UserError(f"{path}: ratio {g['ratio']} of {g['modules'][0]} is not one of {_fmt(RATIOS)}")
        for m in g["modules"]:
            if m in seen:
                raise UserError(f"{path}: module {m} appears in two groups; regenerate the plan")
            seen[m] = float(g["ratio"])
    if modules is not None:
        missing = sorted(set(modules) - set(seen))
        extra = sorted(set(seen) - set(modules))
        if missing or extra:
            what = f"no ratio for {missing[0]}" if missing else f"unknown module {extra[0]}"
            n = len(missing) + len(extra)
            raise UserError(f"{path} was made for another model ({what}, {n} mismatches): re-run calibrate and plan on this model")
    return plan


def module_ratios(plan: dict) -> dict[str, float]:
    """{module: ratio} of a plan (members of a fused group share it)."""
    return {m: float(g["ratio"]) for g in plan["groups"] for m in g["modules"]}


def uniform_plan(scores: dict, ratio: float) -> dict:
    """A plan with the same ratio everywhere (the baseline a budget plan is compared with)."""
    groups = []
    for g in scores["groups"]:
        by_ratio = {float(k): v for k, v in g["scores"].items()}
        groups.append(
            {
                "modules": list(g["modules"]),
                "ratio": float(ratio),
                "score": by_ratio.get(float(ratio)),
                "bits": bits_of(ratio),
                "weight_count": g["weight_count"],
            }
        )
    return {"budget": bits_of(ratio), "achieved_bits": bits_of(ratio), "satisfied": True, "method": "uniform", "groups": groups}
