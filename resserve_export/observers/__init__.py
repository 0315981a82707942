"""Layer 4: hooks that watch a forward pass (activation statistics, expert statistics, input capture, input Hessians, KV cache)."""
