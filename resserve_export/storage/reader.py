"""Reading safetensors tensors ahead of use into reusable buffers ("slabs").

`SlabReader` reads a list of tensors of a `safetensors.SafetensorsFiles` into one slab with
positioned reads of `READ_CHUNK` bytes (no mmap: bounded memory, and a truncated or unreadable
file is a one-line `safetensors.unreadable` error). With threads, the chunks are read by a thread
pool (one submission's chunks in parallel, submissions in order) while the caller works on the
previous one. Slabs are pinned on CUDA so that the copies to the device are asynchronous; a slab
handed back with the CUDA event of its last host-to-device copy is overwritten only once that
event is done (the reader threads wait for it, not the caller).

Only the calling thread takes and hands back slabs, so reader threads never wait for memory.
`pack` reads each decision group's weights ahead with it, and the layer-by-layer calibration
each decoder layer's tensors.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from resserve_export.storage.safetensors import ST_DTYPES, unreadable

READ_CHUNK = 16 << 20  # bytes per positioned read; one submission's chunks are read in parallel
ALIGN = 4096  # each tensor starts at this alignment in its slab


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the slab alignment."""
    return -(-nbytes // ALIGN) * ALIGN


def places(source, names) -> tuple[dict[str, int], list[str], int]:
    """Where the tensors `names` of `source` lie in a slab: {name: offset}, the names whose bytes
    are read (the first of each range: the parts of one stored tensor, e.g. an expert's gate and
    up projections out of its fused ``gate_up_proj``, share the bytes read once), and the slab's
    bytes."""
    at: dict[str, int] = {}
    first: dict[tuple, int] = {}
    reads: list[str] = []
    off = 0
    for n in names:
        e = source.entries[n]
        key = (e.path, e.start, e.nbytes)
        if key not in first:
            first[key] = off
            reads.append(n)
            off += aligned(e.nbytes)
        at[n] = first[key]
    return at, reads, off


def slab_bytes(source, names) -> int:
    """Bytes of a slab that holds the tensors `names` of `source`."""
    return places(source, names)[2]


class Slab:
    """One reusable read buffer (pinned on CUDA), and the CUDA event after which its last
    host-to-device copy is done (None: free to overwrite)."""

    def __init__(self, nbytes: int, pin: bool):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.event = None


@dataclass
class Reading:
    """Tensors submitted to a `SlabReader`: the slab they are read into, and the reads
    (futures, or None for a read already done) that `SlabReader.wait` waits for."""

    slab: Slab
    at: dict[str, int]  # name -> offset in the slab
    jobs: list[Future | None]


class SlabReader:
    """Reads lists of tensors of `source` into up to `slabs` slabs of `nbytes` bytes each
    (pinned when `pin`).

    With `threads` > 0 the chunks are read by that many threads named `thread_name`-N; with 0
    they are read by the caller when submitted. `chunk`: bytes per read (default `READ_CHUNK`)."""

    def __init__(self, source, nbytes: int, slabs: int, *, pin: bool, threads: int, thread_name: str = "read", chunk: int | None = None):
        self.source, self.nbytes, self.slabs, self.pin = source, nbytes, slabs, pin
        self.chunk = chunk or READ_CHUNK
        self.free: list[Slab] = []
        self.made = 0
        self.fds: dict[Path, int] = {}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=thread_name) if threads > 0 else None

    def __enter__(self) -> SlabReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def take(self) -> Slab | None:
        """A free slab (a new one while fewer than `slabs` exist), or None: hand one back first."""
        if self.free:
            return self.free.pop()
        if self.made < self.slabs:
            self.made += 1
            return Slab(self.nbytes, self.pin)
        return None

    def give(self, slab: Slab, event=None) -> None:
        """Hand `slab` back, to be overwritten once `event` (its last copy's CUDA event) is done."""
        slab.event = event
        self.free.append(slab)

    def _fd(self, name: str, e) -> int:
        fd = self.fds.get(e.path)
        if fd is None:
            try:
                fd = self.fds[e.path] = os.open(e.path, os.O_RDONLY)
            except OSError as err:
                raise unreadable(name, e.path.name, err.strerror or str(err)) from None
        return fd

    def submit(self, names: list[str], slab: Slab) -> Reading:
        """Start reading the tensors `names` into `slab` (after its event)."""
        jobs: list[Future | None] = []
        at, reads, _ = places(self.source, names)
        for name in reads:
            e = self.source.entries[name]
            fd = self._fd(name, e)
            view = slab.buf[at[name] : at[name] + e.nbytes]
            for a in range(0, e.nbytes, self.chunk):
                args = (fd, name, e, view, a, min(a + self.chunk, e.nbytes), slab.event)
                jobs.append(self.pool.submit(read_chunk, *args) if self.pool is not None else read_chunk(*args))
        return Reading(slab, at, jobs)

    def wait(self, reading: Reading) -> dict[str, torch.Tensor]:
        """{name: tensor} of a submitted reading once read: views of its slab in each tensor's
        stored dtype and shape (new tensors for parts of stored ones: `safetensors.Part`). Raises
        the first read error."""
        for j in reading.jobs:
            if j is not None:
                j.result()
        out = {}
        for name, off in reading.at.items():
            e = self.source.entries[name]
            out[name] = e.present(reading.slab.buf[off : off + e.nbytes].view(ST_DTYPES[e.dtype][0]))
        return out

    def close(self) -> None:
        """Stop the reads not started yet, wait for the running ones, and close the files."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def read_chunk(fd: int, name: str, e, view: torch.Tensor, a: int, b: int, event) -> None:
    """Bytes [a, b) of tensor `name` (entry `e`, in the open file `fd`) into ``view[a:b]``, after
    `event` (the slab's last copy to the device)."""
    if event is not None:
        event.synchronize()
    mv = memoryview(view.numpy())[a:b]
    done = 0
    while done < b - a:
        try:
            got = os.preadv(fd, [mv[done:]], e.start + a + done)
        except OSError as err:
            raise unreadable(name, e.path.name, err.strerror or str(err)) from None
        if got == 0:
            raise unreadable(name, e.path.name, "the file is truncated")
        done += got


__all__ = ["READ_CHUNK", "ALIGN", "Slab", "Reading", "SlabReader", "aligned", "places", "slab_bytes", "read_chunk"]
