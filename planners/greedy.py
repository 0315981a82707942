"""Greedy baseline: start from the cheapest option of every group, then repeatedly take the
upgrade with the largest score reduction per unit of extra cost that still fits.

Fast and often close, but not optimal on a knapsack (it can strand budget); the ILP is the
reference and `bench/plan.py` reports the gap.
"""

from __future__ import annotations

import heapq

from .problem import Problem, canonicalize


def _push_upgrades(heap: list, problem: Problem, l: int, j: int) -> None:
    s0, c0 = problem.scores[l][j], problem.costs[l][j]
    for k, (s, c) in enumerate(zip(problem.scores[l], problem.costs[l])):
        if s < s0:
            gain = (s0 - s) / (c - c0) if c > c0 else float("inf")
            # Ties: larger gain first, then lower group index, then cheaper option.
            heapq.heappush(heap, (-gain, l, c, k, j))


def solve(problem: Problem) -> list[int]:
    problem.check_feasible()
    choice = [min(range(len(c)), key=lambda k: (c[k], s[k], k)) for s, c in zip(problem.scores, problem.costs)]
    spent = sum(problem.costs[l][j] for l, j in enumerate(choice))
    heap: list = []
    for l, j in enumerate(choice):
        _push_upgrades(heap, problem, l, j)
    while heap:
        _, l, c, k, j = heapq.heappop(heap)
        if choice[l] != j:
            continue  # stale: the group has moved since this upgrade was offered
        extra = c - problem.costs[l][j]
        if spent + extra > problem.capacity:
            continue  # spending only grows, so it never fits later
        choice[l] = k
        spent += extra
        _push_upgrades(heap, problem, l, k)
    return canonicalize(problem, choice)
