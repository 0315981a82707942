"""`pack`'s read / quantize / write pipeline: the same bytes as one thread doing everything, and
an error in any stage ends the run with one line and nothing written."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from resserve_export.storage import reader, safetensors
from resserve_export.stages.pack import stream as stream_module
from resserve_export.cli import main
from resserve_export.stages.pack.inputs import DEPTH_ENV, pipeline_depth
from resserve_export.stages.pack.run import pack
from resserve_export.storage import checkpoint

from tests.fixtures.checkpoints import fail_writes_after
from tests.fixtures.tiny import make_calibration, make_model



@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, Path]:
    """Six layers in several source shards: enough groups for a deep queue to fill."""
    root = tmp_path_factory.mktemp("pipeline")
    model = make_model(root / "model", num_hidden_layers=6, shard_size="60KB")
    assert len(list(model.glob("*.safetensors"))) > 2
    return model, make_calibration(model, root / "calib")


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pack-")]


@pytest.mark.parametrize("fmt,ratio", [("nvfp4", 0.25), ("mxfp4", 0.5), ("nvfp4", 1.0)])
def test_pipelined_bytes_equal_serial(sharded, tmp_path, monkeypatch, fmt, ratio):
    model, calib = sharded
    kw = dict(ratio=ratio, device="cpu", max_shard_size="20KB", progress=False)
    monkeypatch.setenv(DEPTH_ENV, "0")
    serial = pack(model, calib, tmp_path / "serial", fmt, **kw).out
    assert len(list(serial.glob("model-*.safetensors"))) > 2

    # A deep queue, reads in odd-sized chunks by several threads, two slabs in all, the larger
    # groups read member by member, and copies through memory instead of the kernel.
    monkeypatch.setenv(DEPTH_ENV, "5")
    monkeypatch.setattr(reader, "READ_CHUNK", 1000)
    monkeypatch.setattr(stream_module, "READERS", 3)
    monkeypatch.setattr(stream_module, "READ_AHEAD_BYTES", 1)
    monkeypatch.setattr(stream_module, "GROUP_CACHE_BYTES", 20_000)
    monkeypatch.setattr(stream_module, "COPY_CHUNK", 1000)

    def no_kernel_copy(*a):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", no_kernel_copy, raising=False)
    real_group = stream_module.pack_group

    def slow_group(*a, **k):
        time.sleep(0.01)  # the readers run ahead: a slab handed back too early would be overwritten
        return real_group(*a, **k)

    monkeypatch.setattr(stream_module, "pack_group", slow_group)
    piped = pack(model, calib, tmp_path / "piped", fmt, **kw).out
    assert files(piped) == files(serial)
    assert pipeline_threads() == []


def test_default_depth_pipelines_and_matches_serial(sharded, tmp_path, monkeypatch):
    model, calib = sharded
    monkeypatch.delenv(DEPTH_ENV, raising=False)
    assert pipeline_depth() >= 2
    seen = set()
    real = safetensors.ShardedWriter.write

    def write(self, name, tensor):
        seen.add(threading.current_thread().name)
        return real(self, name, tensor)

    monkeypatch.setattr(safetensors.ShardedWriter, "write", write)
    piped = pack(model, calib, tmp_path / "piped", "nvfp4", ratio=0.25, progress=False).out
    assert seen == {"pack-write"}  # written by the writer thread, not the quantizing one
    monkeypatch.setenv(DEPTH_ENV, "1")
    seen.clear()
    serial = pack(model, calib, tmp_path / "serial", "nvfp4", ratio=0.25, progress=False).out
    assert seen == {threading.current_thread().name}
    assert files(piped) == files(serial)


def _one_line_error(argv, capsys, out: Path) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))
    assert pipeline_threads() == []
    return lines[0]


@pytest.mark.parametrize("depth", ["0", "4"])
def test_writer_error_leaves_nothing(sharded, tmp_path, monkeypatch, capsys, depth):
    model, calib = sharded
    monkeypatch.setenv(DEPTH_ENV, depth)
    calls = fail_writes_after(monkeypatch, 12, errno.EIO, "Input/output error")
    out = tmp_path / "ck"
    line = _one_line_error(["pack", str(model), "--calib", str(calib), "--out", str(out), "--ratio", "0.25"], capsys, out)
    assert "Input/output error" in line and "nothing was written" in line
    assert calls["n"] > 12


@pytest.mark.parametrize("depth", ["0", "4"])
def test_reader_error_leaves_nothing(sharded, tmp_path, monkeypatch, capsys, depth):
    model, calib = sharded
    monkeypatch.setenv(DEPTH_ENV, depth)
    calls = {"n": 0}
    real = os.preadv

    def failing(fd, buffers, offset, *a):
        calls["n"] += 1
        if calls["n"] > 8:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "preadv", failing)
    out = tmp_path / "ck"
    line = _one_line_error(["pack", str(model), "--calib", str(calib), "--out", str(out), "--ratio", "0.25"], capsys, out)
    assert line.startswith("error: cannot read model.layers.") and "Input/output error" in line, line


def test_bad_depth_is_refused_before_any_work(sharded, tmp_path, monkeypatch, capsys):
    model, calib = sharded
    monkeypatch.setenv(DEPTH_ENV, "deep")
    out = tmp_path / "ck"
    line = _one_line_error(["pack", str(model), "--calib", str(calib), "--out", str(out), "--ratio", "0"], capsys, out)
    assert DEPTH_ENV in line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (quantization on --device cuda)")
def test_cuda_pipeline_with_a_deep_queue_writes_the_cpu_serial_bytes(sharded, tmp_path, monkeypatch):
    """Pinned slabs reused after their host-to-device copy, outputs copied back asynchronously:
    the bytes of a serial pack on the CPU."""
    model, calib = sharded
    kw = dict(ratio=0.25, max_shard_size="20KB", progress=False)
    monkeypatch.setenv(DEPTH_ENV, "0")
    serial = pack(model, calib, tmp_path / "serial", "nvfp4", device="cpu", **kw).out
    monkeypatch.setenv(DEPTH_ENV, "5")
    monkeypatch.setattr(reader, "READ_CHUNK", 1000)
    monkeypatch.setattr(stream_module, "READ_AHEAD_BYTES", 1)
    piped = pack(model, calib, tmp_path / "piped", "nvfp4", device="cuda", **kw).out
    assert files(piped) == files(serial)
    assert pipeline_threads() == []
