"""How vLLM's own code reads a checkpoint's KV-cache declaration and scale names (no engine).

Usage: python kv_config.py CKPT OUT.json [CKPT OUT.json ...] (several checkpoints in one process,
vLLM imported once). For each checkpoint, writes what vLLM makes of the checkpoint: the KV-cache
dtype `--kv-cache-dtype auto` resolves to, the KV algorithm its ModelOpt config parses from
config.json and from hf_quant_config.json, where its scale-name mapper puts every stored k / v
scale, and whether the KV-scale parameter's loader accepts each stored tensor.
"""

import json
import sys
from pathlib import Path


def main(ckpt: str, out_path: str) -> None:
    from safetensors.torch import load_file
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter
    from vllm.utils.torch_utils import get_kv_cache_quant_algo_string

    import resserve_export.vllm_plugin as plugin

    plugin.register()
    d = Path(ckpt)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    stock = get_quantization_config("modelopt_fp4")
    out = {
        "auto_kv_cache_dtype": get_kv_cache_quant_algo_string(qc),
        "config_json": stock.from_config({k: v for k, v in qc.items() if k != "resserve"}).kv_cache_quant_algo,
        "hf_quant_config": stock.from_config(json.loads((d / "hf_quant_config.json").read_text())).kv_cache_quant_algo,
    }
    resserve = get_quantization_config("resserve").from_config(qc)
    out["resserve_inner"] = type(resserve.inner).__name__
    mapper = resserve.get_cache_scale_mapper()
    idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    mapped, loaded = {}, {}
    for f in sorted(set(idx.values())):
        for name, t in load_file(str(d / f)).items():
            if name.endswith(("k_scale", "v_scale")):
                mapped[name] = mapper._map_name(name)
                p = KVCacheScaleParameter()
                KVCacheScaleParameter.weight_loader(p, t)
                loaded[name] = [float(p), float(t.reshape(()))]
    out["mapped"], out["loaded"] = mapped, loaded
    json.dump(out, open(out_path, "w"))


if __name__ == "__main__":
    args = sys.argv[1:]
    assert args and len(args) % 2 == 0, "usage: kv_config.py CKPT OUT.json [CKPT OUT.json ...]"
    for ckpt, out in zip(args[::2], args[1::2]):
        main(ckpt, out)
