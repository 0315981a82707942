"""Layer 6: the stages a user runs (calibrate, plan, pack, verify, size, inspect), each over the layers below."""
