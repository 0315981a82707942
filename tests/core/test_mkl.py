"""MKL's code path is pinned by the API (and so by every command), unless the user chose one."""

from __future__ import annotations

import os
import subprocess
import sys

from resserve_export.core import mkl


def _cbwr_after_import(env: dict) -> str:
    code = "import os, resserve_export.api; print(os.environ.get('MKL_CBWR'))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.strip()


def test_the_api_pins_mkls_code_path_and_keeps_the_users():
    env = {k: v for k, v in os.environ.items() if k != mkl.ENV}
    assert _cbwr_after_import(env) == "AVX2"
    assert _cbwr_after_import({**env, mkl.ENV: "COMPATIBLE"}) == "COMPATIBLE"
