"""What the plugin registers with vLLM (imported only when vLLM is importable).

- the CPU platform gets vLLM's own ``EmulationNvFp4LinearKernel`` for NVFP4 linears (it has no
  NVFP4 kernel of its own), preceded by a variant that dequantizes weights once at load
  (:class:`.kernels.CachedEmulationNvFp4LinearKernel`, same arithmetic), and our pure-torch :class:`CpuMxfp4LinearKernel` for MXFP4 linears
  (vLLM's MXFP4 emulation needs ``amd-quark`` and CUDA-only kernels);
- on the CPU platform, FP4 mixture-of-experts kernels for vLLM's own ModelOpt NVFP4 and
  compressed-tensors MXFP4 MoE methods (:mod:`.moe`), which find none there;
- the ``resserve`` quantization method (:mod:`.method`), which takes over a checkpoint whose
  ``quantization_config`` has a ``resserve`` section unless the user names another method.

``RESSERVE_VLLM_METHOD=0`` registers the kernels only: the engine then serves an extended
checkpoint exactly as stock vLLM does (plain W4A4, sidecar ignored).
"""

from __future__ import annotations

from resserve_export.vllm_plugin.settings import method_enabled

_done = False


def register_all() -> None:
    global _done
    if _done:
        return
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    from resserve_export.formats.registry import MXFP4, NVFP4
    from resserve_export.vllm_plugin.kernels import CachedEmulationNvFp4LinearKernel, CpuMxfp4LinearKernel

    # Tried in order: the cached variant first, vLLM's own emulation as the fallback.
    register_linear_kernel(CachedEmulationNvFp4LinearKernel, PlatformEnum.CPU, NVFP4.stock_kernel)
    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, NVFP4.stock_kernel)
    register_linear_kernel(CpuMxfp4LinearKernel, PlatformEnum.CPU, MXFP4.stock_kernel)
    from resserve_export.vllm_plugin.moe import register_cpu_moe

    register_cpu_moe()
    if method_enabled():
        from resserve_export.vllm_plugin import method  # noqa: F401  (registers "resserve" on import)
    _done = True
