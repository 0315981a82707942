"""The planning problem shared by every solver: a multiple-choice knapsack with integer costs."""

from __future__ import annotations

import math
from dataclasses import dataclass


class Infeasible(ValueError):
    """No assignment meets the capacity (even the cheapest option of every group exceeds it)."""


@dataclass(frozen=True)
class Problem:
    """Choose exactly one option per group, total cost ≤ capacity, minimising the total score.

    scores[l][j] and costs[l][j] describe option j of group l. Costs are integers so that the
    budget test is exact (no floating-point tolerance decides feasibility).
    """

    scores: tuple[tuple[float, ...], ...]
    costs: tuple[tuple[int, ...], ...]
    capacity: int

    def __post_init__(self) -> None:
        if len(self.scores) != len(self.costs):
            raise ValueError("scores and costs must have one row per group")
        for s, c in zip(self.scores, self.costs):
            if len(s) != len(c) or not s:
                raise ValueError("every group needs the same, non-zero number of scores and costs")
            if any(not math.isfinite(v) for v in s):
                raise ValueError("scores must be finite")
            if any(int(v) != v or v < 0 for v in c):
                raise ValueError("costs must be non-negative integers")

    @property
    def num_groups(self) -> int:
        return len(self.scores)

    def min_cost(self) -> int:
        return sum(min(c) for c in self.costs)

    def check_feasible(self) -> None:
        if self.min_cost() > self.capacity:
            raise Infeasible(f"the cheapest assignment costs {self.min_cost()} > capacity {self.capacity}")


def objective(problem: Problem, choice: list[int]) -> float:
    return math.fsum(problem.scores[l][j] for l, j in enumerate(choice))


def total_cost(problem: Problem, choice: list[int]) -> int:
    return sum(problem.costs[l][j] for l, j in enumerate(choice))


def canonicalize(problem: Problem, choice: list[int]) -> list[int]:
    """Deterministic tie-break: in each group, among options with exactly the chosen score, take
    the cheapest (then the lowest index). Never raises the cost, never changes the objective."""
    out = []
    for l, j in enumerate(choice):
        s = problem.scores[l][j]
        ties = [k for k in range(len(problem.scores[l])) if problem.scores[l][k] == s]
        out.append(min(ties, key=lambda k: (problem.costs[l][k], k)))
    return out
