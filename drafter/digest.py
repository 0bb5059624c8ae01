"""Weight digests: one sha256 over a drafter's trainable weights, from what a process serves or
read straight from a spot checkpoint, so a push can be checked to serve the checkpoint it names.

Both sides hash the same thing: what a checkpoint saves of the drafter (its parameters and saved
buffers: EAGLE-3's draft-vocabulary map decides what is drafted), each name and its bytes in name
order, floating tensors in one dtype (the serving dtype: a checkpoint's fp32 weights are cast as a
bf16 server casts them), integer and bool ones in their own. Unsaved buffers (rotary frequencies)
and the target's frozen embedding / LM head are not drafter weights and are left out on both sides.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tlt.drafter.checkpoint import step_dir, unreadable

_PREFIX = "train.model."  # where a spot checkpoint keeps the drafter's weights (TrainState "model")


def weights_digest(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> str:
    """sha256 of ``(name, tensor)`` pairs, each floating tensor cast to ``dtype`` on the host."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda x: x[0]):
        data = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
        h.update(name.encode())
        h.update(str(tuple(data.shape)).encode())
        h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def module_digest(module: nn.Module, dtype: torch.dtype | None = None) -> str:
    """Digest of what ``module`` saves, in its parameters' dtype unless ``dtype`` is given."""
    params = list(module.parameters())
    return weights_digest(module.state_dict().items(), dtype or (params[0].dtype if params else torch.float32))


def checkpoint_weights(root: str | Path, step: int) -> dict[str, torch.Tensor]:
    """The drafter weights of spot checkpoint ``step`` (drafter names, checkpoint dtype), read by
    this process alone (no model needed: shapes and dtypes come from the checkpoint's metadata)."""
    path = step_dir(root, step)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a complete checkpoint")
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith(_PREFIX) and isinstance(m, TensorStorageMetadata)}
    if not state:
        raise ValueError(f"{path} holds no drafter weights (no {_PREFIX}* keys)")
    try:
        dcp.load(state, checkpoint_id=path, no_dist=True)
    except CheckpointException as e:  # a BaseException: the push guard's callers catch Exception
        raise unreadable(path, e) from e
    return {k[len(_PREFIX):]: t for k, t in state.items()}


def checkpoint_digest(root: str | Path, step: int, dtype: torch.dtype) -> str:
    """Digest of the drafter weights of spot checkpoint ``step``."""
    return weights_digest(checkpoint_weights(root, step).items(), dtype)


def canary_digest(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, elements: int) -> str:
    """Digest of the first ``elements`` values of each tensor, as a server serving them in ``dtype``
    reads them back (a partial read-back, when a server cannot hand out whole tensors)."""
    return weights_digest(((n, t.detach().to("cpu", dtype).flatten()[:elements].float()) for n, t in named),
                          torch.float32)
