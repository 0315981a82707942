"""The progress display of `compute_scores`: two phases on the terminal (building the candidates'
weights, then scoring in batch × group × ratio units) when the caller passes no callback of its
own. Kept apart from the arithmetic so the scores never import the UI unless it is shown.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from resserve_export.core.ui import phases

Tick = Callable[[int, int], None]


@contextmanager
def scoring_progress(
    progress: Tick | None, show: bool, method: str, n_groups: int, n_ratios: int, num_samples: int
) -> Iterator[tuple[Tick | None, Tick | None]]:
    """Yields ``(weights progress, scoring progress)``, each called as ``(done, total)``.

    With a caller's `progress`, or when not `show`: ``(None, progress)`` and nothing is drawn.
    Otherwise a rich progress bar per phase (`ui.phases`), closed on exit, an exception included.
    """
    if progress is not None or not show:
        yield None, progress
        return

    with phases() as tick:
        reached: dict[str, int] = {}

        def absolute(desc: str) -> Tick:
            def update(d: int, t: int) -> None:
                tick(desc, d - reached.get(desc, 0), t)
                reached[desc] = d

            return update

        yield (
            absolute(f"quantizing weights ({n_groups} groups × {n_ratios} ratios)"),
            absolute(f"scoring ({method}, {num_samples} samples, batch × group × ratio)"),
        )
