"""`compiling.compile_or_eager`: the compiled graph while Dynamo accepts it, the eager function
(bit-identical) once it refuses a recompilation."""

from __future__ import annotations

import functools

import pytest
import torch

from resserve_export.core import compiling
from resserve_export.formats import ops as formats
from resserve_export.formats.mxfp4 import ScaleRounding


def _scale_add(x: torch.Tensor, *, k: float) -> torch.Tensor:
    return x * k + 1.0


def test_limits_are_raised():
    compiling.compile_or_eager(_scale_add, dynamic=False)
    assert torch._dynamo.config.recompile_limit >= compiling.RECOMPILE_LIMIT


def test_falls_back_to_eager_when_the_recompile_limit_is_hit():
    # Partials of one function share Dynamo's frame; with a budget of one compilation the second
    # shape is refused, which fullgraph=True turns into an error: the wrapper runs eagerly instead.
    fn = compiling.compile_or_eager(functools.partial(_scale_add, k=3.0), dynamic=False, fullgraph=True)
    torch._dynamo.reset()
    a, b = torch.randn(4, 8), torch.randn(5, 3)
    with torch._dynamo.config.patch(recompile_limit=1):
        assert torch.equal(fn(a), a * 3.0 + 1.0)
        with pytest.warns(RuntimeWarning, match="recompile limit"):
            out = fn(b)
        assert torch.equal(out, b * 3.0 + 1.0)
        assert torch.equal(fn(a), a * 3.0 + 1.0)  # eager from now on, same values


def test_compiled_quantizer_survives_many_configurations():
    # The MXFP4 block quantizer is one partial per rounding: every format and rounding in one
    # process, then again, stays bit-identical to the reference backend.
    torch._dynamo.reset()
    x = torch.randn(64, 4096)
    for _ in range(2):
        for fmt, rounding in (("nvfp4", "ceil"), ("mxfp4", "ceil"), ("mxfp4", "floor"), ("mxfp4", "even")):
            alpha = torch.tensor(0.01) if fmt == "nvfp4" else None
            got = formats.quantize(x, fmt, alpha=alpha, rounding=ScaleRounding(rounding), backend="compiled")
            want = formats.quantize(x, fmt, alpha=alpha, rounding=ScaleRounding(rounding), backend="reference")
            assert torch.equal(got.codes, want.codes) and torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))


def test_falls_back_to_eager_when_compilation_fails(monkeypatch):
    """A compiler error (as inductor raised on torch 2.11 for the scores' preparation graph) runs
    the eager function instead; an error of the function itself still reaches the caller."""

    def broken_compile(fn, **options):
        def run(*args, **kwargs):
            raise RuntimeError("backend compiler failed")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    fn = compiling.compile_or_eager(functools.partial(_scale_add, k=2.0), fullgraph=True)
    x = torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match="RuntimeError"):
        assert torch.equal(fn(x), x * 2.0 + 1.0)
    with pytest.raises(TypeError):
        fn("not a tensor")


def test_limits_are_raised_in_every_calling_thread():
    """Dynamo's config is thread-local since torch 2.12, including the autograd engine's GPU
    threads, where the grad scores' hooks call compiled graphs: a thread that calls the wrapper
    gets the raised budget too, instead of falling back to eager after 8 shapes."""
    import threading
    import warnings

    fn = compiling.compile_or_eager(functools.partial(_scale_add, k=5.0), backend="eager", dynamic=False, fullgraph=True)
    torch._dynamo.reset()
    shapes = [(n, 3) for n in range(2, 2 + compiling.RECOMPILE_LIMIT // 4)]
    caught, ok = [], []

    def work():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ok.extend(torch.equal(fn(x), x * 5.0 + 1.0) for x in (torch.randn(*s) for s in shapes))
        caught.extend(str(m.message) for m in w)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert ok == [True] * len(shapes)
    assert not [m for m in caught if "torch.compile" in m], caught
