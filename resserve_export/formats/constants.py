"""Format limits and layout constants, each named once (docs/formats.md)."""

# E2M1 (FP4) element (docs/formats.md, "The FP4 element"; OCP MX v1.0).
F4_E2M1_MAX = 6.0
F4_SIGN_BIT = 0b1000
# Magnitudes of codes 0..7.
F4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# FP8 E4M3 (NVFP4 block scale).
F8_E4M3_MAX = 448.0
F8_E4M3_MIN_SCALE = 2.0**-9  # smallest subnormal; block scales are clamped to it

# NVFP4 (docs/formats.md, "NVFP4"): α = amax / (6 · 448).
NVFP4_BLOCK = 16
NVFP4_GLOBAL_DIVISOR = F4_E2M1_MAX * F8_E4M3_MAX  # 2688.0

# MXFP4 (docs/formats.md, "MXFP4"): E8M0 scale, bias 127.
MXFP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
# Exponent of the largest E2M1 value (6 = 1.5 · 2²): the OCP floor rule subtracts it.
F4_E2M1_MAX_POW2 = 2

# Block-local selection (docs/formats.md, "Channel selection and masks").
SELECTION_GROUP = 8
PARTIAL_RATIOS = (0.125, 0.25, 0.5)
RATIOS = (0.0, 0.125, 0.25, 0.5, 1.0)

# Per-format values (block size, the K-Ext padding, ...) live on the format objects of
# `registry`, the one place a format's name is branched on.
