"""How a runner process gets its copy kernels: emulated on CPU, or the real ones on a GPU.

One place, so that the CPU and GPU variants differ here and nowhere else.

* CPU (``emulate``): harness/emulation/__init__.py's process-wide emulation, below SGLang's
  Python kernel wrappers (the wrappers, their argument handling and the JIT gates run as
  they are). Host memory cannot be registered with CUDA here, and SGLang's cache
  controller asks torch for CUDA streams and events: both are pointed at the CPU
  (``torch.cpu`` streams run copies eagerly), as the CPU tier's controller tests do.
* GPU (``real``): nothing is replaced. Pinned host memory, CUDA streams, the JIT
  kernels built by nvcc, and whatever sgl_kernel the machine has. Only SGLang's
  ``cudaHostRegister`` calls are noted, so that ``release_host_memory`` can unregister
  what a case left registered: a host pool whose constructor raised after pinning its
  buffer is never destroyed (a server would exit), and the next case's buffer, mapped
  at the same address, would fail to register (cudaErrorHostMemoryAlreadyRegistered).
"""
from __future__ import annotations

import torch


def emulate():
    """Install the CPU emulation for the rest of the process; returns its undo."""
    from sglang.srt.managers import cache_controller
    from sglang.srt.mem_cache import l2_transfer
    from sglang.srt.mem_cache.pool_host import common

    from harness.emulation import install_kernel_emulation

    undo = install_kernel_emulation()
    for module in (cache_controller, l2_transfer):
        module.device_module = torch.cpu
    common._cuda_host_register = lambda *args, **kwargs: None
    return undo


_registered: list[torch.Tensor] = []


def real():
    """Check that the real kernels can run here: a CUDA device, and say which sgl_kernel."""
    if not torch.cuda.is_available():
        raise SystemExit("--real-kernels needs a CUDA device")
    from sglang.srt.mem_cache.pool_host import common

    register = common._cuda_host_register

    def noted(buffer, *args, **kwargs):
        register(buffer, *args, **kwargs)
        _registered.append(buffer)

    common._cuda_host_register = noted
    try:
        import sgl_kernel
    except ImportError:
        return "sgl_kernel: not installed"
    if getattr(sgl_kernel, "IS_SGL_KERNEL_STUB", False):
        return "sgl_kernel: import stand-in (AOT ops raise NotImplementedError)"
    return f"sgl_kernel {getattr(sgl_kernel, '__version__', '?')}"


def release_host_memory():
    """After a case: unregister every buffer it pinned that no destroy() released."""
    if not _registered:
        return
    from sglang.srt.mem_cache.pool_host import common

    torch.cuda.synchronize()
    while _registered:
        common._cuda_host_unregister(_registered.pop())
