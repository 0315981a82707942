"""Shared test fixtures. Keep this small: helpers used by more than one test file only."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.fixtures.moe import moe, moe_scored  # noqa: F401 (session fixtures: tiny MoE models, a scored calibration)

torch.set_num_threads(2)
# ModelOpt warns on import that it was not tested with our transformers; the warning is noise here.
warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")


def pytest_configure(config):
    # Noise raised inside ModelOpt / compressed-tensors imports, not ours.
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script.* is deprecated:DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore:.*is not tested with current version of modelopt:UserWarning")


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: every random tensor in a test is reproducible."""
    return torch.Generator().manual_seed(1234)
