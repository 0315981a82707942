"""Converted models go into the user's model cache whole, also when two processes convert the
same file at once (the CPU and vLLM suites, two commands on a fresh machine)."""

from __future__ import annotations

import pytest

from resserve_export.modeling import modelio


def _conversion(root, name: str, marker: str):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_text(marker)
    return d


def test_the_first_finished_conversion_is_kept(tmp_path):
    out = tmp_path / "model"
    modelio._publish(_conversion(tmp_path, ".tmp-a", "a"), out)
    late = _conversion(tmp_path, ".tmp-b", "b")
    modelio._publish(late, out)
    assert (out / "model.safetensors").read_text() == "a"
    assert not late.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_directory_in_the_way_that_is_no_conversion_is_an_error(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("not a model")
    with pytest.raises(OSError):
        modelio._publish(_conversion(tmp_path, ".tmp-a", "a"), out)
