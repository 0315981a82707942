"""The safetensors file format as `pack` writes and every reader reads it: the dtype table, tensor
layouts and header bytes, the split into shards with their index, a streaming sharded writer and a
plain-read reader.

A file is an 8-byte little-endian header length, a JSON header (``{name: {dtype, shape,
data_offsets}}`` plus ``__metadata__``, padded with spaces to 8 bytes) and the tensors' bytes in
header order (https://github.com/huggingface/safetensors#format). Sharded files are named
``<prefix>-0000i-of-0000n.safetensors`` and listed in an index JSON (``weight_map``), as
transformers writes them.

`ShardedWriter` writes from a layout fixed in advance (names, dtypes, shapes), so headers are
known before any data is produced: tensors stream to disk one by one, memory stays bounded and
the same inputs give byte-identical files.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from resserve_export.core.errors import UserError

# Written into every safetensors header (as transformers does).
ST_METADATA = {"format": "pt"}

# copy_file_range errors that mean "not between these files" (copy through memory instead)
WRITEBACK_BYTES = 64 << 20  # ShardedWriter starts the disk write of each this many bytes at once


def _writeback_starter():
    """``start(fd, offset, nbytes)``: begin writing a file range to disk without waiting
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that the fsync before a checkpoint's
    rename finds little left to write; a no-op where the call does not exist."""
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return lambda fd, offset, nbytes: None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; errors ignored: a hint


_start_writeback = _writeback_starter()

_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ETXTBSY, errno.EPERM}

# safetensors dtype name -> (torch dtype, element size)
ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
_TORCH_TO_ST = {v[0]: k for k, v in ST_DTYPES.items()}


def st_dtype(dtype: torch.dtype) -> str:
    return _TORCH_TO_ST[dtype]


def shard_name(prefix: str, i: int, n: int) -> str:
    """``model-00001-of-00003.safetensors`` (i counts from 1)."""
    return f"{prefix}-{i:05d}-of-{n:05d}.safetensors"


def parse_size(text: str | int) -> int:
    """``5GB`` -> 5·10⁹, ``500MiB`` -> 500·2²⁰, plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"size {text!r} is not understood: write e.g. 5GB, 500MB, 2GiB or a byte count")
    unit = m.group(2).upper().rstrip("B")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    value = int(float(m.group(1)) * mult[unit])
    if value <= 0:
        raise UserError(f"size {text!r} must be positive")
    return value


# --------------------------------------------------------------------------------------------
# Tensor layout and safetensors headers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """Name, safetensors dtype and shape of one output tensor (known before its data)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_DTYPES[self.dtype][1]


def header_bytes(specs: list[TensorSpec], metadata: dict | None = None) -> bytes:
    """The safetensors header (8-byte length + JSON padded to 8 bytes) for tensors in this order."""
    hdr: dict = {}
    if metadata:
        hdr["__metadata__"] = dict(metadata)
    off = 0
    for s in specs:
        hdr[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(hdr, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def split_shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split in order: a new shard starts when the next tensor would exceed `max_bytes`
    (a tensor larger than the limit gets a shard of its own)."""
    shards: list[list[TensorSpec]] = []
    cur: list[TensorSpec] = []
    size = 0
    for s in specs:
        if cur and size + s.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s.nbytes
    if cur:
        shards.append(cur)
    return shards


def file_bytes(shards: list[list[TensorSpec]]) -> int:
    """Exact bytes on disk of these shards (headers + data)."""
    return sum(len(header_bytes(sh, ST_METADATA)) + sum(s.nbytes for s in sh) for sh in shards)


def index_json(prefix: str, shards: list[list[TensorSpec]]) -> dict:
    n = len(shards)
    weight_map = {s.name: shard_name(prefix, i + 1, n) for i, sh in enumerate(shards) for s in sh}
    total = sum(s.nbytes for sh in shards for s in sh)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


class ShardedWriter:
    """Writes tensors into pre-planned safetensors shards, strictly in layout order.

    The layout (names, dtypes, shapes per shard) is fixed at construction, so each file's header
    is written before its data and every tensor goes straight to disk.
    """

    def __init__(self, directory: Path, prefix: str, shards: list[list[TensorSpec]]):
        self.directory, self.prefix, self.shards = Path(directory), prefix, shards
        self._order = [(i, s) for i, sh in enumerate(shards) for s in sh]
        self._pos = 0
        self._file = None
        self._file_index = -1
        self._synced = 0  # bytes of the open file whose write to disk has been started
        self.paths: list[Path] = []

    @property
    def names(self) -> list[str]:
        return [s.name for _, s in self._order]

    def _write_bytes(self, data) -> None:
        self._file.write(data)

    def _writeback(self) -> None:
        """Start writing the file's bytes to disk once `WRITEBACK_BYTES` more have been written."""
        end = self._file.tell()
        if end - self._synced >= WRITEBACK_BYTES:
            self._file.flush()
            _start_writeback(self._file.fileno(), self._synced, end - self._synced)
            self._synced = end

    def _open(self, i: int) -> None:
        self._close_file()
        path = self.directory / shard_name(self.prefix, i + 1, len(self.shards))
        self._file = open(path, "wb", buffering=1 << 20)
        self._file_index = i
        self._synced = 0
        self.paths.append(path)
        self._write_bytes(header_bytes(self.shards[i], ST_METADATA))

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def next_spec(self) -> TensorSpec | None:
        return self._order[self._pos][1] if self._pos < len(self._order) else None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor of the layout (its name, dtype and shape must match)."""
        i, spec = self._expect(name)
        if st_dtype(tensor.dtype) != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{name}: got {st_dtype(tensor.dtype)} {tuple(tensor.shape)}, layout says {spec.dtype} {spec.shape}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._write_bytes(memoryview(data))
        self._pos += 1
        self._writeback()

    def write_raw(self, name: str, chunks) -> None:
        """Write the next tensor from an iterable of byte chunks (a verbatim copy)."""
        _, spec = self._expect(name)
        n = 0
        for c in chunks:
            n += len(c)
            self._write_bytes(c)
        if n != spec.nbytes:
            raise ValueError(f"{name}: copied {n} bytes, layout says {spec.nbytes}")
        self._pos += 1
        self._writeback()

    def copy_from(self, name: str, fd: int, start: int, buffer: bytearray, source: str = "the source") -> None:
        """Write the next tensor as a verbatim copy of its size in bytes at offset `start` of the
        open file `fd` (named `source` in errors): copied by the kernel (``copy_file_range``, no
        pass through this process's memory) where the file systems allow it, else read through
        `buffer`."""
        _, spec = self._expect(name)
        self._file.flush()  # the kernel copy writes at the file's position
        done = 0
        if hasattr(os, "copy_file_range"):
            try:
                while done < spec.nbytes:
                    got = os.copy_file_range(fd, self._file.fileno(), spec.nbytes - done, start + done)
                    if got == 0:
                        break  # the rest goes through the reads below, which report a truncation
                    done += got
            except OSError as e:
                if e.errno not in _NO_KERNEL_COPY:
                    raise
        view = memoryview(buffer)
        while done < spec.nbytes:
            got = os.preadv(fd, [view[: min(len(view), spec.nbytes - done)]], start + done)
            if got == 0:
                raise unreadable(name, source, "the file is truncated")
            self._write_bytes(view[:got])
            done += got
        self._pos += 1
        self._writeback()

    def _expect(self, name: str) -> tuple[int, TensorSpec]:
        if self._pos >= len(self._order):
            raise ValueError(f"{name}: the layout has no more tensors")
        i, spec = self._order[self._pos]
        if spec.name != name:
            raise ValueError(f"expected tensor {spec.name} next, got {name}")
        if i != self._file_index:
            self._open(i)
        return i, spec

    def close(self) -> None:
        """Flush and fsync; every planned tensor must have been written."""
        self._close_file()
        if self._pos != len(self._order):
            missing = [s.name for _, s in self._order[self._pos :]]
            raise ValueError(f"{len(missing)} tensors were not written, first {missing[0]}")

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def index(self) -> dict:
        return index_json(self.prefix, self.shards)


# --------------------------------------------------------------------------------------------
# Reader (no mmap: bounded memory, clear errors on truncated files)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """A tensor presented in place of part of a stored one (`SafetensorsFiles.add_parts`): the
    `index`-th sub-tensor along the first dimension of `source` (contiguous on disk), of which the
    rows ``start:stop:step``, or, `transposed`, the columns ``start:stop:step`` transposed. E.g.
    one expert's gate projection ``[I, H]`` out of experts fused on disk as ``gate_up_proj``
    ``[E, 2I, H]``: ``Part(…, e, 0, I)``; out of ``[E, H, 2I]``: ``Part(…, e, 0, I, transposed=True)``."""

    source: str
    index: int
    start: int
    stop: int
    step: int = 1
    transposed: bool = False

    def shape(self, stored: tuple[int, int]) -> tuple[int, int]:
        """The part's shape, cut from a sub-tensor of shape `stored`."""
        rows, cols = stored
        n = len(range(self.start, self.stop, self.step))
        return (n, rows) if self.transposed else (n, cols)

@dataclass(frozen=True)
class _Entry:
    path: Path
    dtype: str
    shape: tuple[int, ...]  # as presented
    start: int  # absolute byte offset in the file of the bytes read
    nbytes: int  # bytes read
    part: Part | None = None  # presented as this part of the bytes read (their stored shape: `stored`)
    stored: tuple[int, ...] = ()

    def present(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor as presented, from the bytes read viewed in their dtype."""
        if self.part is None:
            return t.reshape(self.shape)
        p, t = self.part, t.reshape(self.stored)
        if p.transposed:
            return t[:, p.start : p.stop : p.step].t().contiguous()
        return t[p.start : p.stop : p.step].contiguous()


class SafetensorsFiles:
    """Tensors of several safetensors files, read by offset with plain file reads.

    Headers are validated up front (JSON, dtypes, offsets within the file), so a corrupted or
    truncated shard is reported before a long job starts.
    """

    def __init__(self, paths: list[Path]):
        self.entries: dict[str, _Entry] = {}
        self.metadata: dict[Path, dict] = {}
        for p in paths:
            self._scan(Path(p))

    def _scan(self, path: Path) -> None:
        bad = f"cannot read {path.name}: the shard looks corrupted or truncated, re-download or re-export it"
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise UserError(bad)
                (n,) = struct.unpack("<Q", head)
                if n > min(size - 8, 100 << 20):
                    raise UserError(bad)
                hdr = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError):
            raise UserError(bad) from None
        if not isinstance(hdr, dict):
            raise UserError(bad)
        self.metadata[path] = hdr.pop("__metadata__", None) or {}
        base = 8 + n
        for name, info in hdr.items():
            try:
                dtype, shape, (b, e) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
                nbytes = math.prod(shape) * ST_DTYPES[dtype][1]
            except (KeyError, TypeError, ValueError):
                raise UserError(bad) from None
            if e - b != nbytes or b < 0 or base + e > size:
                raise UserError(bad)
            self.entries[name] = _Entry(path, dtype, shape, base + b, nbytes)

    def add_parts(self, parts: dict[str, Part]) -> None:
        """Present each `parts` name as that part of a stored 3-D tensor (or of a 2-D one, index 0;
        a 4-D one's sub-tensors ``[R, G, B]`` are cut as ``[R, G·B]``), and hide the stored
        tensors they are cut from: readers then see, e.g., one 2-D weight per expert where the
        file holds every expert of a layer in one tensor."""
        for name, p in parts.items():
            src = self.entries.get(p.source)
            whole = src is not None and len(src.shape) == 2 and p.index == 0  # a 2-D tensor is its own one sub-tensor
            if src is None or src.part is not None or not (whole or len(src.shape) in (3, 4) and 0 <= p.index < src.shape[0]):
                raise ValueError(f"{name}: {p.source} is not a stored 3-D tensor with a sub-tensor {p.index}")
            stored = src.shape if whole else (src.shape[1], math.prod(src.shape[2:]))
            extent = stored[1] if p.transposed else stored[0]
            if not 0 <= p.start < p.stop <= extent:
                raise ValueError(f"{name}: {p.start}:{p.stop}:{p.step} is outside {p.source}'s {extent}")
            each = src.nbytes if whole else src.nbytes // src.shape[0]
            self.entries[name] = _Entry(src.path, src.dtype, p.shape(stored), src.start + p.index * each, each, p, stored)
        for p in {p.source for p in parts.values()}:
            del self.entries[p]

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {k: (e.dtype, e.shape) for k, e in self.entries.items()}

    def spec(self, name: str) -> TensorSpec:
        e = self.entries[name]
        return TensorSpec(name, e.dtype, e.shape)

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read into fresh memory."""
        return self.read_into(name, torch.empty(self.entries[name].nbytes, dtype=torch.uint8))

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """The tensor read into `out` (uint8, at least its size; e.g. a pinned staging buffer),
        returned as a view of it in its dtype and shape (a new tensor for a `Part`)."""
        e = self.entries[name]
        buf = out[: e.nbytes]
        with open(e.path, "rb", buffering=0) as f:
            f.seek(e.start)
            got = f.readinto(memoryview(buf.numpy())) if e.nbytes else 0
        if got != e.nbytes:
            raise unreadable(name, e.path.name, "the file is truncated")
        return e.present(buf.view(ST_DTYPES[e.dtype][0]))


def unreadable(name: str, shard: str, why: str) -> UserError:
    """The one-line error for tensor `name` that cannot be read from the file `shard`."""
    return UserError(f"cannot read {name} from {shard}: {why}, re-download or re-export it")


__all__ = [
    "ST_DTYPES",
    "ST_METADATA",
    "st_dtype",
    "ShardedWriter",
    "SafetensorsFiles",
    "Part",
    "TensorSpec",
    "header_bytes",
    "split_shards",
    "file_bytes",
    "index_json",
    "shard_name",
    "parse_size",
    "unreadable",
]
