"""Exhaustive search over every assignment: the ground truth for tests on small instances."""

from __future__ import annotations

import itertools
import math

from .problem import Infeasible, Problem, canonicalize

MAX_ASSIGNMENTS = 2_000_000


def solve(problem: Problem) -> list[int]:
    n = math.prod(len(s) for s in problem.scores)
    if n > MAX_ASSIGNMENTS:
        raise ValueError(f"{n} assignments is too many for brute force (limit {MAX_ASSIGNMENTS})")
    problem.check_feasible()
    best: tuple[float, int, tuple[int, ...]] | None = None
    for choice in itertools.product(*(range(len(s)) for s in problem.scores)):
        cost = sum(problem.costs[l][j] for l, j in enumerate(choice))
        if cost > problem.capacity:
            continue
        key = (math.fsum(problem.scores[l][j] for l, j in enumerate(choice)), cost, choice)
        if best is None or key < best:
            best = key
    if best is None:  # pragma: no cover - check_feasible already ruled this out
        raise Infeasible("no assignment meets the capacity")
    return canonicalize(problem, list(best[2]))
