"""Terminal output shared by the commands: consoles for tables, and progress of long steps.

Progress goes to stderr. On a terminal it is a live rich bar (count, rate, elapsed, ETA); when
stderr is a pipe or a file (CI logs, `nohup`, `| tee`) it is a plain log line every
``RESSERVE_LOG_SECONDS`` seconds (default 5) and one when the step ends, so a long run is never
silent.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

from rich.console import Console

# Wide enough for the per-layer tables; rich falls back to 80 columns when output is piped.
MIN_PIPED_WIDTH = 140
LOG_SECONDS_ENV = "RESSERVE_LOG_SECONDS"
# Tests only: seconds to sleep at every progress step, so that a signal can be sent mid-run.
TEST_STEP_DELAY_ENV = "RESSERVE_TEST_STEP_DELAY"


def say(line: str) -> None:
    """One line on stderr in one write: under torchrun every rank shares the pipe, and a print
    (text, then its newline: two writes) lets two ranks' lines run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def console(**kw):
    """A rich Console that does not squash tables to 80 columns when stdout is a pipe or file."""

    if not sys.stdout.isatty() and "width" not in kw:
        kw["width"] = MIN_PIPED_WIDTH
    return Console(**kw)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


class Progress:
    """Progress of one step over `total` units (``unit="bytes"`` formats sizes).

    ``advance(n, rate=k)`` counts `n` units done; `rate_unit` names a second quantity whose rate
    is shown instead of the units' (e.g. tokens per second while counting samples).
    """

    def __init__(self, desc: str, total: int, *, unit: str = "", rate_unit: str | None = None, enabled: bool = True):
        self.desc, self.total, self.unit, self.rate_unit, self.enabled = desc, max(int(total), 0), unit, rate_unit, enabled
        self.done = self.base = 0
        self.rated = 0
        self.note = ""
        self.t0 = self._last = time.monotonic()
        self.interval = float(os.environ.get(LOG_SECONDS_ENV, "5") or 5)
        self.delay = float(os.environ.get(TEST_STEP_DELAY_ENV, "0") or 0)
        self._bar = None

    def __enter__(self) -> Progress:
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RichProgress

            count = [DownloadColumn(), TransferSpeedColumn()] if self.unit == "bytes" else [MofNCompleteColumn(), TextColumn(self.unit)]
            rate = [TextColumn("{task.fields[rate]}")] if self.rate_unit else []
            self._bar = RichProgress(
                TextColumn("{task.description}"), BarColumn(), *count, *rate, TimeElapsedColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), console=Console(stderr=True),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.desc, total=self.total, rate="")
        return self

    def _rate(self, elapsed: float) -> str:
        if self.rate_unit:
            return f"{self.rated / elapsed:,.0f} {self.rate_unit}/s"
        if self.unit == "bytes":
            return f"{_bytes((self.done - self.base) / elapsed)}/s"
        return f"{(self.done - self.base) / elapsed:,.2f} {self.unit or 'steps'}/s"

    def line(self) -> str:
        """The plain log line (also what a piped run prints)."""
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        if self.unit == "bytes":
            count = f"{_bytes(self.done)}/{_bytes(self.total)}"
        else:
            count = f"{self.done}/{self.total}" + (f" {self.unit}" if self.unit else "")
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        eta = ""
        if self.base < self.done < self.total:
            eta = f", ETA {_clock(elapsed * (self.total - self.done) / (self.done - self.base))}"
        note = f" [{self.note}]" if self.note else ""
        return f"{self.desc}{note}: {count}{pct}, {self._rate(elapsed)}, {_clock(elapsed)} elapsed{eta}"

    def describe(self, note: str) -> None:
        """Show what is being worked on now (e.g. a layer name)."""
        self.note = note
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.desc} {note}")

    def start_at(self, n: int) -> None:
        """Units already done before this run (a resumed run): counted, but not in the rate or ETA."""
        self.done = self.base = n
        self.t0 = time.monotonic()
        if self._bar is not None:
            self._bar.reset(self._task, total=self.total, completed=n, rate="")

    def advance(self, n: int = 1, *, rate: int = 0) -> None:
        self.done += n
        self.rated += rate
        if self._bar is not None:
            elapsed = max(time.monotonic() - self.t0, 1e-9)
            self._bar.update(self._task, advance=n, rate=self._rate(elapsed) if self.rate_unit else "")
        elif self.enabled:
            now = time.monotonic()
            if now - self._last >= self.interval:
                self._last = now
                say(self.line())
        if self.delay:
            time.sleep(self.delay)

    def __exit__(self, exc_type, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, *exc)
        elif self.enabled and exc_type is None:
            say(self.line())


@contextmanager
def phases(enabled: bool = True):
    """Yields ``tick(phase, advance, total)``: one `Progress` per phase, each closed when the next begins."""
    current: list = [None, None]  # phase name, Progress

    def tick(phase: str, advance: int, total: int) -> None:
        if current[0] != phase:
            if current[1] is not None:
                current[1].__exit__(None, None, None)
            current[0], current[1] = phase, Progress(phase, total, enabled=enabled).__enter__()
        current[1].advance(advance)

    try:
        yield tick
    finally:
        if current[1] is not None:
            exc = sys.exc_info()
            current[1].__exit__(*exc)
