"""Output paths: checks before any work, atomic directories and files, stale temporaries.

Every command that writes builds its output in a hidden sibling and renames it into place
when complete, so an interrupted or failed run leaves no output behind. Hidden siblings carry
the writing process's id (``.NAME.tmp-PID-…``, ``.NAME.offload-PID-…``, ``.NAME.old-PID-…``;
``.NAME.partial-PID`` from packs of earlier versions); a later run for the same output removes
those whose process is gone (a killed run cannot clean up after itself).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from resserve_export.core.errors import UserError

_KINDS = ("tmp", "offload", "partial", "old")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain ``open(path, "w")`` would give a new file (0644 under umask 022)."""
    return 0o666 & ~_umask()


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _existing_ancestor(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists():
        p = p.parent
    return p


def check_writable(path: Path, *, flag: str = "--out", need_bytes: int | None = None) -> None:
    """Refuse, before any work, an output whose directory cannot be created or written.

    Probes by creating (and removing) a hidden directory in the nearest existing ancestor, so a
    read-only file system, a missing permission or a file in the way is found even as root.
    With `need_bytes`, also refuses when that ancestor's file system has less free space.
    """
    base = _existing_ancestor(Path(path).parent)
    if not base.is_dir():
        raise UserError(f"cannot write {flag} {path}: {base} is a file, not a directory; choose another {flag}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".resserve-probe-", dir=base))
    except OSError as e:
        raise UserError(f"cannot write {flag} {path}: {e.strerror or e} in {base}; choose another {flag}") from None
    if need_bytes is not None:
        free = shutil.disk_usage(base).free
        if free < need_bytes:
            raise UserError(
                f"not enough disk space for {flag} {path}: it needs {need_bytes / 1e9:.2f} GB, {free / 1e9:.2f} GB free in {base}"
            )


def check_out_dir(out: Path, overwrite: bool, *, flag: str = "--out", need_bytes: int | None = None) -> None:
    """Refuse an output that is a file, a non-empty directory without `overwrite`, or not writable."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory: pass another {flag}")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"output directory {out} exists and is not empty: pass --overwrite to replace it or choose another {flag}")
    check_writable(out, flag=flag, need_bytes=need_bytes)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: Path) -> list[Path]:
    """Remove hidden siblings of `out` left by runs whose process no longer exists; returns them."""
    out = Path(out).absolute()
    if not out.parent.is_dir():
        return []
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(?:{'|'.join(_KINDS)})-(\d+)(?:-.*)?$")
    removed = []
    for p in out.parent.iterdir():
        m = pattern.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def temp_sibling(out: Path, kind: str) -> Path:
    """A new hidden directory ``.NAME.KIND-PID-…`` next to `out`."""
    assert kind in _KINDS
    out = Path(out).absolute()
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-{os.getpid()}-", dir=out.parent))


def write_dir_atomic(out: Path, write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Build `out` in a temporary sibling, fsync, then rename; on any failure nothing is left behind.

    ``write(tmp)`` fills the temporary directory. An existing `out` is replaced only with
    `overwrite` and only once the new one is complete. Files get the mode a plain ``open`` would
    give them (not mkstemp's 0600).
    """
    out = Path(out)
    check_out_dir(out, overwrite)
    clean_stale(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out, "tmp")
    old = None
    try:
        write(tmp)
        mode = file_mode()
        for p in sorted(tmp.iterdir()):
            os.chmod(p, mode)
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o777 & ~_umask())
        fsync_dir(tmp)
        if out.exists():
            old = temp_sibling(out, "old")
            os.replace(out, old / "d")
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and (old / "d").exists() and not out.exists():
            os.replace(old / "d", out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def write_file_atomic(path: Path, write: Callable, *, flag: str = "--out") -> None:
    """Write one file through a temporary sibling and a rename; ``write(fileobj)`` fills it (binary)."""
    path = Path(path)
    check_writable(path, flag=flag)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), file_mode())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["check_out_dir", "check_writable", "clean_stale", "temp_sibling", "write_dir_atomic", "write_file_atomic", "fsync_dir", "file_mode"]
