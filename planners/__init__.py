"""Ratio planners (docs/formats.md, "Ratio planner"): pick one residue ratio per decision group under an effective-bits budget.

All solvers take a `Problem` (multiple-choice knapsack: one option per group, integer costs, one
capacity) and return the chosen option index per group:

- `ilp.solve`    — exact integer program in PuLP (CBC by default, HiGHS when available), gapRel=0;
- `greedy.solve` — marginal-gain baseline (fast, not always optimal);
- `brute.solve`  — exhaustive search, for tests on small instances.
"""

from .problem import Infeasible, Problem, canonicalize, objective, total_cost

SOLVERS = ("cbc", "highs", "greedy")


def solve(problem: Problem, solver: str = "cbc") -> list[int]:
    """Chosen option per group with the named solver (see `SOLVERS`)."""
    if solver in ("cbc", "highs"):
        from . import ilp

        return ilp.solve(problem, solver=solver)
    if solver == "greedy":
        from . import greedy

        return greedy.solve(problem)
    if solver == "brute":
        from . import brute

        return brute.solve(problem)
    raise ValueError(f"unknown solver {solver!r}, available: {list(SOLVERS)}")


__all__ = ["Infeasible", "Problem", "SOLVERS", "canonicalize", "objective", "solve", "total_cost"]
