"""Exact planner: an integer linear program in PuLP (docs/formats.md, "Ratio planner").

One binary x[l, j] per (group, option), Σ_j x[l, j] = 1 for every group, Σ cost·x ≤ capacity,
minimise Σ score·x. Solved to optimality (gapRel = 0) by CBC (bundled with PuLP) or HiGHS (pulp's
API to `highspy`, when installed). Single-threaded, fixed options: the same problem gives the same
answer; exact score ties are then broken by `canonicalize` (cheapest option).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings

from .problem import Infeasible, Problem, canonicalize, total_cost


def available(solver: str) -> bool:
    import pulp

    name = {"cbc": "PULP_CBC_CMD", "highs": "HiGHS"}[solver]
    return name in pulp.listSolvers(onlyAvailable=True)


def _backend(solver: str, time_limit: float | None):
    import pulp

    if solver == "cbc":
        # The CBC binary bundled with PuLP; PuLP 3.3 warns that 4.0 will unbundle it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, gapRel=0, gapAbs=0, threads=1, timeLimit=time_limit)
    if solver == "highs":
        if not available("highs"):
            raise RuntimeError("the HiGHS solver needs the 'highspy' package: pip install highspy, or use --solver cbc")
        return pulp.HiGHS(msg=False, gapRel=0, gapAbs=0, threads=1, timeLimit=time_limit)
    raise ValueError(f"unknown ILP solver {solver!r}, available: ['cbc', 'highs']")


@contextlib.contextmanager
def _quiet_stdout(enabled: bool):
    """HiGHS prints its banner from C++ on file descriptor 1 even with output off: silence it."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            try:
                yield
            finally:
                os.dup2(saved, 1)
    finally:
        os.close(saved)


def solve(problem: Problem, solver: str = "cbc", time_limit: float | None = None) -> list[int]:
    import pulp

    problem.check_feasible()
    # Scale scores to O(1) so the solver's absolute tolerances mean the same thing for any metric,
    # and costs by their common divisor so the budget row has small integer coefficients.
    smax = max((abs(s) for row in problem.scores for s in row), default=0.0) or 1.0
    g = 0
    for row in problem.costs:
        for c in row:
            g = math.gcd(g, c)
    g = g or 1
    cap = problem.capacity // g

    prob = pulp.LpProblem("resserve_plan", pulp.LpMinimize)
    if hasattr(prob, "add_variable"):  # PuLP ≥ 3.3 attaches variables to the model
        def var(name):
            return prob.add_variable(name, 0, 1, cat=pulp.LpBinary)
    else:  # pragma: no cover - older PuLP
        def var(name):
            return pulp.LpVariable(name, 0, 1, cat=pulp.LpBinary)
    x = [[var(f"x_{l}_{j}") for j in range(len(row))] for l, row in enumerate(problem.scores)]
    prob += pulp.lpSum(problem.scores[l][j] / smax * x[l][j] for l in range(len(x)) for j in range(len(x[l])))
    for l, row in enumerate(x):
        prob += pulp.lpSum(row) == 1, f"one_{l}"
    prob += pulp.lpSum(problem.costs[l][j] // g * x[l][j] for l in range(len(x)) for j in range(len(x[l]))) <= cap, "budget"
    with _quiet_stdout(solver == "highs"):
        status = prob.solve(_backend(solver, time_limit))
    if pulp.LpStatus[status] == "Infeasible":
        raise Infeasible("the solver found no assignment within the budget")
    if pulp.LpStatus[status] != "Optimal":
        raise RuntimeError(f"the {solver} solver stopped with status {pulp.LpStatus[status]}")
    choice = [max(range(len(row)), key=lambda j: row[j].varValue or 0.0) for row in x]
    if total_cost(problem, choice) > problem.capacity:  # integrality tolerance; never trust it silently
        raise RuntimeError("the solver returned an assignment over the budget")
    return canonicalize(problem, choice)
