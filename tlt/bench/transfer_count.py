"""Counting host <-> device transfers in a block of code, whatever the device.

Owns :func:`count_transfers` and :func:`count_per_call`. While active, a ``TorchFunctionMode`` sees
every torch call and tells *host* tensors from *device* tensors by how they were made, so a count
taken on a CPU means what it would on CUDA (where each of these makes the host wait or copies over
PCIe):

* a host tensor is made without a ``device=`` argument (``torch.tensor(list)``, ``torch.arange(k)``),
  by ``.cpu()``, or from host tensors only; every other tensor is a device tensor (made before the
  block, with ``device=``, or from a device tensor);
* **read** (device -> host): ``item``, ``tolist``, ``bool``, ``int``, ``float``, ``__index__``,
  ``numpy`` or ``cpu()`` of a device tensor, ``.to(cpu, copy=True)`` of one (or any ``.to`` a CPU
  target when the counter's device is not the CPU), a data-dependent shape (``nonzero``,
  ``masked_select``, ``unique``, indexing with a boolean tensor) or ``equal`` / ``allclose``;
* **upload** (host -> device): ``torch.tensor`` / ``as_tensor`` / ``asarray`` of Python data with a
  ``device=`` argument, ``new_tensor`` of a device tensor, ``.to(device)`` or ``.cuda()`` of a host
  tensor;
* **mixed**: any other call given a device tensor and a host tensor of one or more dimensions
  (indexing a device tensor with a host index, ``copy_`` from the host; a 0-dim host tensor
  passes as a scalar), or a device tensor indexed
  with a Python list: an implicit upload.

Each transfer is attributed to its call site (the first frame outside torch and this module).
Reads of host tensors and device ops on device tensors cost nothing here. Not thread-safe; for
tests and benches, not for production.

The engine marks the transfers it means to make with :func:`tlt.rollout.transfers.intended_sync`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_T = torch.Tensor
_READS = {_T.item, _T.tolist, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.numpy, _T.cpu,
          # a result whose shape or value the host needs: the host waits for the device
          torch.nonzero, _T.nonzero, torch.masked_select, _T.masked_select, torch.unique, _T.unique,
          torch.equal, _T.equal, torch.allclose, _T.allclose}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_TORCH_DIR = os.path.dirname(torch.__file__)
_MARK = "_tlt_host"


@dataclasses.dataclass
class TransferCount:
    reads: int = 0
    uploads: int = 0
    mixed: int = 0
    sites: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # "file:line kind" -> n

    @property
    def total(self) -> int:
        return self.reads + self.uploads + self.mixed

    def add(self, kind: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.sites[f"{_site()} {kind}"] += 1


def _site() -> str:
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(_TORCH_DIR) or f.f_code.co_filename == __file__):
        f = f.f_back
    if f is None:
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def _is_host(t: torch.Tensor) -> bool:
    return getattr(t, _MARK, False)


def _mark(t, host: bool):
    if isinstance(t, torch.Tensor):
        setattr(t, _MARK, host)
    return t


def _target_device(args, kwargs) -> torch.device | None:
    """The device a ``.to(...)`` call names, if any."""
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class _Mode(TorchFunctionMode):
    def __init__(self, count: TransferCount, device: torch.device) -> None:
        super().__init__()
        self.count, self.device = count, device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host_in = [t for t in tensors if _is_host(t)]
        dev_in = [t for t in tensors if not _is_host(t)]
        if func in _READS:
            if dev_in:
                self.count.add("reads")
            if func is _T.cpu:
                return _mark(out.view_as(out) if out is args[0] else out, True)
            return out
        if func is _T.new_tensor:
            if not _is_host(args[0]) and kwargs.get("device") is None:
                self.count.add("uploads")
            return out
        if func is _T.__getitem__ and dev_in and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.count.add("reads")  # a boolean mask: the result's size is read on the host
            return out
        if func in _FROM_DATA:
            if kwargs.get("device") is None:
                return _mark(out, True) if not dev_in else out
            if not tensors or host_in:
                self.count.add("uploads")
            return out
        if func in (_T.to, _T.cuda):
            target = torch.device("cuda") if func is _T.cuda else _target_device(args, kwargs)
            src = args[0]
            if target is None:  # a dtype change: stays where it is
                return _mark(out, _is_host(src)) if out is not src else out
            if _is_host(src):
                if target.type == "cpu" and self.device.type != "cpu":
                    return _mark(out, True)  # host to host
                self.count.add("uploads")
                return out.view_as(out) if out is src else out  # a fresh (unmarked) device tensor
            if target.type == "cpu" and (self.device.type != "cpu" or kwargs.get("copy")):
                self.count.add("reads")
                return _mark(out.view_as(out) if out is src else out, True)
            return out
        if func in (_T.__getitem__, _T.__setitem__) and dev_in and any(
                isinstance(i, list) for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.count.add("mixed")
        elif dev_in and any(t.dim() > 0 for t in host_in):
            self.count.add("mixed")
        if not tensors:  # a factory: host unless it names a device
            return _mark(out, True) if kwargs.get("device") is None else out
        if not dev_in and kwargs.get("device") is None:  # from host tensors only, and stays there
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and not any(t is s for s in tensors):
                    _mark(t, True)
        return out




@contextlib.contextmanager
def count_transfers(device: torch.device | str = "cpu") -> Iterator[TransferCount]:
    """Count the transfers made inside the block (``device``: the engine's device)."""
    count = TransferCount()
    with _Mode(count, torch.device(device)):
        yield count


@contextlib.contextmanager
def count_per_call(obj: object, method: str, device: torch.device | str = "cpu") -> Iterator[list[TransferCount]]:
    """Inside the block, each call of ``obj.<method>`` is counted on its own (one
    :class:`TransferCount` per call, in order): e.g. an engine's ``_step``, so that prefill and row
    compaction between steps stay out of a step's count."""
    calls: list[TransferCount] = []
    had = method in vars(obj)
    original = getattr(obj, method)

    def counted(*args, **kwargs):
        with count_transfers(device) as c:
            out = original(*args, **kwargs)
        calls.append(c)
        return out

    setattr(obj, method, counted)
    try:
        yield calls
    finally:
        if had:
            setattr(obj, method, original)
        else:
            delattr(obj, method)
