"""Resume points of a layer-by-layer calibration (``calibrate --pipeline sequential --resume``).

A sequential run keeps its state in a hidden sibling of ``--out``, ``.NAME.resume/``:

- ``key.json``: what the run computes (model fingerprint, samples, settings, groups). A resumed
  run must compute the same; otherwise ``--resume`` is refused, naming what differs.
- ``point/``: the latest resume point, written whole into ``point.tmp/`` and renamed into place
  (the one before it stays as ``point.old/`` until then, so a crash while saving leaves one
  valid point). ``meta.json`` says where the run was (``forward`` after layer L, or ``backward``
  with layers ≥ L done); ``state.pt`` holds the accumulators (float64 sums, amax, counts, score
  sums) exactly; ``h{i}.pt`` / ``g{i}.pt`` each batch's hidden states / gradients.
- ``scores-in/{L}/``: layer L's input for the score samples, written once (the backward pass
  recomputes every layer from it).

A point is saved after a layer when `RESUME_ENV` seconds have passed since the last one (and
after the forward passes' last layer); each costs one write of the hidden states. The resumed
run replays nothing: it continues with the saved tensors, bit for bit, so its output equals an
uninterrupted run's. The directory is removed when the calibration completes; a run without
``--resume`` discards a state it finds (saying so). A lock keeps two runs off one state.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

import torch

from resserve_export.core.errors import UserError

RESUME_ENV = "RESSERVE_RESUME_SECONDS"  # seconds between resume points; 0: after every layer; "off": never
DEFAULT_SECONDS = 600.0


def state_dir(out: Path) -> Path:
    out = Path(out).absolute()
    return out.parent / f".{out.name}.resume"


def _interval() -> float | None:
    raw = os.environ.get(RESUME_ENV, "").strip().lower()
    if not raw:
        return DEFAULT_SECONDS
    if raw in ("off", "never", "none"):
        return None
    try:
        v = float(raw)
    except ValueError:
        raise UserError(f"{RESUME_ENV}={raw!r}: use a number of seconds (0: after every layer) or off") from None
    if v < 0:
        raise UserError(f"{RESUME_ENV}={raw!r}: use a number of seconds >= 0 (0: after every layer) or off")
    return v


def _fsynced_save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class ResumePoints:
    """The state directory of one sequential run (see the module docstring)."""

    def __init__(self, root: Path, interval: float | None, lock_fd: int, say=None):
        self.root, self.interval, self._lock, self._say = root, interval, lock_fd, say
        self.last = time.monotonic()

    @classmethod
    def open(cls, out: Path, key: dict, resume: bool, say=None) -> ResumePoints:
        """Take the state of ``--out`` (locked): with `resume`, one whose key equals `key`; without,
        a fresh one (an existing state is discarded, and `say` told why)."""
        interval = _interval()
        root = state_dir(out)
        if resume and not cls._has_point(root):
            raise UserError(f"--resume: no interrupted layer-by-layer calibration of --out {out} to continue: run without --resume")
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UserError(f"another calibrate run is writing --out {out} now: wait for it to end, or choose another --out") from None
        self = cls(root, interval, fd, say)
        try:
            if resume:
                old = json.loads((root / "key.json").read_text())
                differ = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
                if differ:
                    raise UserError(
                        f"--resume: the interrupted run of --out {out} computed something else ({', '.join(differ)} differ): "
                        "run without --resume to start over"
                    )
            else:
                where = self.where()
                if where is not None and say is not None:
                    say(f"note: discarding the state of an interrupted run of --out {out} ({where}); --resume continues such a run")
                for p in root.iterdir():
                    if p.name != "lock":
                        shutil.rmtree(p) if p.is_dir() else p.unlink()
                (root / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
        except BaseException:
            self.release()
            raise
        return self

    @staticmethod
    def _point_of(root: Path) -> Path | None:
        for name in ("point", "point.old"):
            p = root / name
            if (p / "meta.json").is_file():
                return p
        return None

    @classmethod
    def _has_point(cls, root: Path) -> bool:
        return (root / "key.json").is_file() and cls._point_of(root) is not None

    def where(self) -> str | None:
        """Where the saved point is, in words (None without one)."""
        p = self._point_of(self.root)
        if p is None:
            return None
        m = json.loads((p / "meta.json").read_text())
        if m["phase"] == "forward":
            return f"layer {m['layer'] + 1} of {m['layers']} done"
        return f"statistics done, scores of {m['layers'] - m['layer']} of {m['layers']} layers done"

    def due(self) -> bool:
        return self.interval is not None and time.monotonic() - self.last >= self.interval

    def _best_effort(self, write) -> None:
        """Run `write`; if the disk refuses it (full, quota, I/O error), stop saving points and go on:
        a resume point must never end the run it is there to protect."""
        if self.interval is None:
            return
        try:
            write()
        except OSError as e:
            self.interval = None
            for p in [*self.root.glob("*.tmp"), *self.root.glob("scores-in/*.tmp")]:
                shutil.rmtree(p, ignore_errors=True)  # the last complete point stays usable
            if self._say is not None:
                self._say(f"warning: cannot save a resume point in {self.root} ({e.strerror or e}): the run goes on without new ones")

    def save(self, meta: dict, state: dict, tensors: dict) -> None:
        """A new point: `state` (CPU objects), and per name in `tensors` (an iterable, read once
        and lazily) one file per batch."""
        self._best_effort(lambda: self._save(meta, state, tensors))

    def _save(self, meta: dict, state: dict, tensors: dict) -> None:
        tmp = self.root / "point.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        counts = {}
        for name, items in tensors.items():  # one tensor in memory at a time
            counts[name] = 0
            for t in items:
                _fsynced_save(t.detach().to("cpu"), tmp / f"{name}{counts[name]}.pt")
                counts[name] += 1
        _fsynced_save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({**meta, "counts": counts}) + "\n")
        point, old = self.root / "point", self.root / "point.old"
        shutil.rmtree(old, ignore_errors=True)
        if point.exists():
            os.replace(point, old)
        os.replace(tmp, point)
        shutil.rmtree(old, ignore_errors=True)
        self.last = time.monotonic()

    def load(self) -> tuple[dict, dict, dict[str, list[Path]]] | None:
        """(meta, state, {name: per-batch file paths}) of the saved point, or None."""
        p = self._point_of(self.root)
        if p is None:
            return None
        meta = json.loads((p / "meta.json").read_text())
        state = torch.load(p / "state.pt", weights_only=False)
        files = {k: [p / f"{k}{i}.pt" for i in range(n)] for k, n in meta["counts"].items()}
        return meta, state, files

    def save_inputs(self, layer: int, items) -> None:
        """Layer `layer`'s score-sample inputs (once; `items` is read only when they are not saved yet)."""
        self._best_effort(lambda: self._save_inputs(layer, items))

    def _save_inputs(self, layer: int, items) -> None:
        d = self.root / "scores-in" / str(layer)
        if d.exists():
            return
        tmp = self.root / "scores-in" / f"{layer}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for i, t in enumerate(items):
            _fsynced_save(t.detach().to("cpu"), tmp / f"h{i}.pt")
        os.replace(tmp, d)

    def inputs(self, layer: int, n: int) -> list[Path] | None:
        d = self.root / "scores-in" / str(layer)
        return [d / f"h{i}.pt" for i in range(n)] if d.is_dir() else None

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def finish(self) -> None:
        """The run completed: the state is no longer needed."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.release()


__all__ = ["RESUME_ENV", "ResumePoints", "state_dir"]
