"""Layer 5: channel selection and K-Ext, emulated linears, the CUDA kernel binding, AWQ, GPTQ, planner scores."""
