"""Terminal output shared by the commands."""

from __future__ import annotations

# Wide enough for the per-layer tables; rich falls back to 80 columns when output is piped.
MIN_PIPED_WIDTH = 140


def console(**kw):
    """A rich Console that does not squash tables to 80 columns when stdout is a pipe or file."""
    import sys

    from rich.console import Console

    if not sys.stdout.isatty() and "width" not in kw:
        kw["width"] = MIN_PIPED_WIDTH
    return Console(**kw)
