"""Import SGLang's Python classes on a CPU-only machine without its GPU stack (test harness).

Call :func:`activate` first thing in the process (before torch's inductor or transformers'
processors are imported): it records in torch that triton is absent (torch caches that answer),
then makes ``triton``, ``torchvision`` and ``sgl_kernel`` importable as inert stubs (every
submodule and name is a placeholder: SGLang's modules import, none of their kernels can run),
hides a ``torchcodec`` whose native library does not load with this torch, and puts the SGLang
install first on ``sys.path``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("triton", "torchvision", "sgl_kernel")
HIDDEN = ("torchcodec",)


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


def _placeholder(name: str):
    return _Meta(name, (), {"__init__": lambda self, *a, **k: None,
                            "__call__": lambda self, *a, **k: _placeholder(name)(),
                            "__getitem__": lambda self, k: _placeholder(name)()})


class _InertModule(types.ModuleType):
    __version__ = "0.0.0+stub"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _InertModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def activate(site_dir: str | None = None) -> None:
    import torch.utils._triton as triton_probe

    triton_probe.has_triton_package()  # cached False before the stub exists
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name in HIDDEN:  # None in sys.modules: import fails, find_spec answers None
        sys.modules.setdefault(name, None)
    if site_dir and site_dir not in sys.path:
        sys.path.insert(0, site_dir)


PATCH_TORCH = "sglang.srt.utils.patch_torch"


class _KeepCpuReducer(importlib.abc.MetaPathFinder):
    """Once SGLang's ``patch_torch`` module is imported, its ``monkey_patch_torch_reductions``
    does nothing: that patch rewrites torch's tensor reducer for CUDA IPC and cannot reduce a CPU
    tensor (``IndexError``), so on a CPU machine pushes keep torch's own reducer."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != PATCH_TORCH:
            return None
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                     for s in [f.find_spec(fullname, path, target)] if s is not None), None)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.monkey_patch_torch_reductions = lambda *a, **k: None

        spec.loader.exec_module = exec_module
        return spec


def cpu_tensor_pushes() -> None:
    """Let SGLang's weight-push serializer carry CPU tensors between processes (a CPU test of
    pushes): torch's own reducer, shared-memory files instead of fds (the receiver is not a child)."""
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    if not any(isinstance(f, _KeepCpuReducer) for f in sys.meta_path):
        sys.meta_path.insert(0, _KeepCpuReducer())
