"""resserve-export: FP4 checkpoints with residue compensation."""

__version__ = "0.1.0"
