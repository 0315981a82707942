"""Layer 1, the format core: E2M1 elements, NVFP4 and MXFP4 blocks, the packed tensor and the format registry."""
