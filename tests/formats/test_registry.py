"""The format registry: formats travel between processes as themselves."""

from __future__ import annotations

import multiprocessing
import pickle

import pytest
import torch

from resserve_export.formats import registry


@pytest.mark.parametrize("fmt", list(registry.FORMATS))
def test_format_pickles_as_its_registry_entry(fmt):
    """vLLM's engine core is a spawned process that receives the quantization method's config by
    pickle; a format must survive that (an unpicklable field once failed the multiprocess engine)."""
    f = registry.get(fmt)
    assert pickle.loads(pickle.dumps(f)) is f
    assert pickle.loads(pickle.dumps({"format": f}, protocol=pickle.HIGHEST_PROTOCOL))["format"] is f


def _block_of(f):
    return f.block, f.quantize_blocks(torch.ones(1, f.block), f.weight_alpha([torch.ones(1, f.block)]), "floor")[0].tolist()


@pytest.mark.parametrize("fmt", list(registry.FORMATS))
def test_format_crosses_a_spawned_process(fmt):
    f = registry.get(fmt)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_block_of, (f,))
    assert got == _block_of(f)
