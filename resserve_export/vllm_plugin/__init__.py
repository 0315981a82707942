"""vLLM plugin: CPU FP4 linear kernels and the `resserve` quantization method.

Registered through the ``vllm.general_plugins`` entry point; vLLM calls :func:`register` in every
process that builds a model. Nothing heavy is imported unless vLLM itself is importable.
"""

from __future__ import annotations


def register() -> None:
    """Entry point called by vLLM's plugin loader."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return
    from resserve_export.vllm_plugin import _register

    _register.register_all()
