"""Layer 2: safetensors files, checkpoints and the calibration directory on disk."""
