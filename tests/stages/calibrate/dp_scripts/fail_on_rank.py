"""`resserve-export` under torchrun with one rank made to fail with a one-line error, for
tests/test_distributed.py: python fail_on_rank.py RANK WHERE ARGS..., WHERE `statistics` (the
rank's statistics pass, either pipeline) or `scores` (the layer-by-layer backward pass, after
the ranks merged their statistics)."""

import os
import sys

from resserve_export.stages.calibrate import ranks
from resserve_export.stages.calibrate import sequential
from resserve_export.cli import main
from resserve_export.core.errors import UserError

rank, where = sys.argv[1], sys.argv[2]
if os.environ.get("RANK") == rank:

    def broken(*args, **kwargs):
        raise UserError(f"injected failure on rank {rank}")

    if where == "statistics":
        ranks.collect = broken  # the name the data-parallel whole-model pipeline calls
        real = sequential.collect_sequential

        def failing_sequential(*args, combine=None, **kwargs):
            return real(*args, combine=lambda col, kvc: broken(), **kwargs)

        sequential.collect_sequential = failing_sequential
    else:
        sequential.grad_scores_backward = broken
main(sys.argv[3:])
