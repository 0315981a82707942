"""Layer 0: errors, progress and tables, compilation helpers, output directories, process groups."""
