"""Tensors presented as parts of stored ones (`safetensors.Part`): what experts fused on disk are
read as. Every way of reading a part (a fresh tensor, a caller's buffer, the read-ahead slabs of
pack and the layer-by-layer calibration) gives the slice torch cuts from the stored tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from resserve_export.storage.reader import SlabReader, aligned, slab_bytes
from resserve_export.storage.safetensors import Part, SafetensorsFiles

E, A, B = 3, 48, 20


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(E, A, B, generator=g).to(torch.bfloat16)
    other = torch.randn(7, 5, generator=g)
    path = tmp_path / "m.safetensors"
    save_file({"x.other": other, "x.fused": fused}, str(path))
    return path, fused, other


# (part, what torch cuts from the stored tensor for it)
CUTS = [
    (Part("x.fused", 0, 0, 24), lambda f: f[0][0:24]),  # rows: output-major, gate half
    (Part("x.fused", 2, 24, 48), lambda f: f[2][24:48]),  # rows: up half of the last expert
    (Part("x.fused", 1, 0, 10, transposed=True), lambda f: f[1][:, 0:10].T),  # input-major gate
    (Part("x.fused", 1, 1, 20, 2, transposed=True), lambda f: f[1][:, 1::2].T),  # interleaved up
    (Part("x.fused", 2, 0, 20, transposed=True), lambda f: f[2].T),  # input-major down: all columns
]


def test_parts_read_as_the_slices_of_the_stored_tensor(stored):
    path, fused, other = stored
    files = SafetensorsFiles([path])
    files.add_parts({f"p{i}": p for i, (p, _) in enumerate(CUTS)})
    # the parts replace the stored tensor they are cut from; the rest is untouched
    assert set(files.keys()) == {"x.other", *(f"p{i}" for i in range(len(CUTS)))}
    assert torch.equal(files.get("x.other"), other)
    names = [f"p{i}" for i in range(len(CUTS))]
    # parts of one sub-tensor (experts 1 and 2 twice each) share its bytes, read once: 3 of 5
    sub = A * B * 2
    assert slab_bytes(files, names) == 3 * aligned(sub)
    with SlabReader(files, slab_bytes(files, names), 1, pin=False, threads=2, chunk=64) as reader:
        slab = reader.take()
        reading = reader.submit(names, slab)
        assert len(reading.jobs) == 3 * -(-sub // 64)
        read = reader.wait(reading)
    for i, (_, cut) in enumerate(CUTS):
        want = cut(fused)
        name = f"p{i}"
        assert files.shapes()[name] == ("BF16", tuple(want.shape))
        assert files.spec(name).shape == tuple(want.shape)
        for got in (files.get(name), files.read_into(name, torch.empty(4096, dtype=torch.uint8)), read[name]):
            assert got.dtype == torch.bfloat16 and got.is_contiguous()
            assert torch.equal(got, want)


@pytest.mark.parametrize("part, match", [
    (Part("x.missing", 0, 0, 4), "not a stored 3-D tensor"),
    (Part("x.other", 1, 0, 4), "not a stored 3-D tensor"),  # 2-D: index 0 only
    (Part("x.fused", E, 0, 4), "not a stored 3-D tensor with a sub-tensor 3"),
    (Part("x.fused", 0, 0, A + 1), "outside x.fused's 48"),
    (Part("x.fused", 0, 0, B + 1, transposed=True), "outside x.fused's 20"),
])
def test_a_part_outside_its_stored_tensor_is_refused(stored, part, match):
    files = SafetensorsFiles([stored[0]])
    with pytest.raises(ValueError, match=match):
        files.add_parts({"p": part})


def test_a_part_of_a_2d_tensor_is_cut_from_the_whole_tensor(stored):
    """A stored 2-D tensor is its own one sub-tensor (index 0): gpt-oss's experts written fused per
    expert (``w13`` ``[K/2, 2I]``, gate and up columns interleaved) read back per linear."""
    path, _, other = stored
    files = SafetensorsFiles([path])
    files.add_parts({"gate": Part("x.other", 0, 0, 5, 2, transposed=True), "up": Part("x.other", 0, 1, 5, 2, transposed=True)})
    assert torch.equal(files.get("gate"), other[:, 0::2].T) and torch.equal(files.get("up"), other[:, 1::2].T)
    assert "x.other" not in files
