"""Layer 3, model adapters: loading, fused groups, experts, the weightless shell, calibration text."""
