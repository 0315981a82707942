"""The plugin's environment switches, read in every vLLM process that builds a model."""

from __future__ import annotations

import os

METHOD_ENV = "RESSERVE_VLLM_METHOD"


def method_enabled() -> bool:
    return os.environ.get(METHOD_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
