"""Intel MKL's code path, pinned so that CPU results do not depend on the processor's vector width.

On CPUs with AVX-512, MKL picks kernels that reduce in another order than its AVX2 ones, and
whose float32 results also vary with the process's history. Measured on a Sapphire Rapids CPU
(torch 2.13's MKL): a layer-by-layer calibration resumed in a fresh process gave grad scores
about 1e-4 (relative) apart from the uninterrupted run's in a process that had run other
calibrations before (tests/storage/test_resume.py); with the pin they are equal. MKL's
conditional numerical reproducibility setting ``MKL_CBWR=AVX2`` gives the AVX2 kernels' results
on every processor that has AVX2 (and the same bits the AVX2 machines computed before), so
results stay reproducible within and across runs. It takes effect when set before MKL's first
computation in the process; a ``MKL_CBWR`` the user set is kept.
"""

from __future__ import annotations

import os

ENV = "MKL_CBWR"
CODE_PATH = "AVX2"


def pin_code_path() -> None:
    """Set ``MKL_CBWR`` to the AVX2 code path unless the environment already names one."""

    os.environ.setdefault(ENV, CODE_PATH)
