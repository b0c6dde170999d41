"""Run SGLang's HiCache copy paths on CPU, emulating only the compiled kernels.

``install_kernel_emulation()`` patches, process-wide, the two places where SGLang's
Python reaches compiled code, and returns a callable that undoes it:

* JIT kernels: ``load_jit`` inside SGLang's wrapper modules
  (kernels/ops/kvcache/hicache.py, kernels/ops/mamba/transfer_mamba.py) becomes
  harness/emulation/jit.py's loader. The wrappers, their argument handling and
  the gates ``can_use_hicache_jit_kernel`` / ``can_use_write_back_jit_kernel`` (which
  build a module to decide) run unchanged; the wrappers' cached modules are emptied on
  install and on undo, so no emulated module outlives the emulation.
* AOT kernels (sglang-kernel, not in SGLang's wheel): every host-pool module that
  imports ``sgl_kernel.kvcacheio`` names under ``if _is_cuda or _is_hip:`` gets
  harness/emulation/aot.py's functions under those names, and the other names
  imported in those blocks (the Mamba JIT wrappers) are bound to SGLang's real ones.

Flags: those same host-pool modules get ``_is_cuda = True``. Without CUDA they
would pick no kernel at all (their ``_is_cuda or _is_hip`` checks decide which copy
functions exist and whether the JIT gates are asked), and on a GPU machine this is
what they see. Nothing else is flipped: pinning and streams stay CPU ones.

Both trees are served: the JIT emulation reads each kernel's signature from the
.cuh files of the tree that is imported (harness/emulation/jit.py), so SGLang 0.5.20 and the
patched tree each get their own kernels.

Used by the CPU tier through the ``kernel_emulation`` / ``host_modules`` fixtures
(tests/cpu/conftest.py), and from plain scripts::

    from harness.emulation import install_kernel_emulation
    undo = install_kernel_emulation()
    ...
    undo()
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

from harness.emulation.aot import KVCACHEIO
from harness.emulation.jit import Recorder, make_loader
from harness.emulation.memory import BOOK, KernelError

WRAPPER_MODULES = ("sglang.kernels.ops.kvcache.hicache", "sglang.kernels.ops.mamba.transfer_mamba")
HOST_PACKAGE = "sglang.srt.mem_cache.pool_host"
EXTRA_HOST_MODULES = ("sglang.srt.mem_cache.memory_pool_host",)
AOT_MODULE = "sgl_kernel.kvcacheio"
_MISSING = object()


class KernelEmulation:
    """The installed emulation; call it to undo. ``recorder`` holds builds and launches."""

    def __init__(self):
        self.recorder = Recorder()
        self.failing_builds: set[str] = set()
        self.host_modules: list = []
        self._saved: list = []
        self._active = False

    def set(self, obj, name, value):
        self._saved.append((obj, name, getattr(obj, name, _MISSING)))
        setattr(obj, name, value)

    def fail_builds(self, *module_names: str):
        """Make the loader fail for these JIT modules (e.g. "hicache"), as a failed compile does."""
        self.failing_builds.update(module_names)

    def __call__(self):
        if not self._active:
            return
        for obj, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._saved.clear()
        BOOK.uninstall()
        self._active = False


def install_kernel_emulation() -> KernelEmulation:
    if BOOK.installed:
        raise KernelError("the kernel emulation is already installed in this process: undo it first")
    emulation = KernelEmulation()
    try:
        BOOK.install()
        emulation._active = True
        _patch_loaders(emulation)
        _patch_host_modules(emulation)
    except BaseException:
        emulation()
        raise
    return emulation


def _patch_loaders(emulation: KernelEmulation):
    from sglang.kernels.jit.utils import KERNEL_PATH, cache_once

    load = make_loader(KERNEL_PATH, emulation.recorder)

    def load_jit(*args, **kwargs):
        if args and args[0] in emulation.failing_builds:
            raise KernelError(f"JIT build of {args[0]} failed (made to fail by the test)")
        return load(*args, **kwargs)

    for name in WRAPPER_MODULES:
        module = importlib.import_module(name)
        emulation.set(module, "load_jit", load_jit)
        for attr, value in list(vars(module).items()):
            # The @cache_once module factories: a fresh, empty cache for the emulation.
            if attr.startswith("_jit_") and hasattr(value, "__wrapped__"):
                emulation.set(module, attr, cache_once(value.__wrapped__))


def host_pool_modules():
    package = importlib.import_module(HOST_PACKAGE)
    names = [f"{HOST_PACKAGE}.{info.name}" for info in pkgutil.iter_modules(package.__path__)]
    return [importlib.import_module(name) for name in (*names, *EXTRA_HOST_MODULES)]


def _cuda_only_imports(module) -> list[ast.ImportFrom]:
    """The `from X import ...` statements under a top-level `if _is_cuda ...:`."""
    found = []
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.If) and "_is_cuda" in {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}:
            found += [n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.ImportFrom)]
    return found


def _patch_host_modules(emulation: KernelEmulation):
    for module in host_pool_modules():
        imports = _cuda_only_imports(module)
        if not imports:
            continue
        for node in imports:
            for alias in node.names:
                if node.module == AOT_MODULE:
                    if alias.name not in KVCACHEIO:
                        raise KernelError(f"{module.__name__} imports {AOT_MODULE}.{alias.name}, which "
                                          "harness/emulation/aot.py does not emulate")
                    value = KVCACHEIO[alias.name]
                else:
                    value = getattr(importlib.import_module(node.module), alias.name)
                emulation.set(module, alias.asname or alias.name, value)
        if hasattr(module, "_is_cuda"):
            emulation.set(module, "_is_cuda", True)
        emulation.host_modules.append(module)
