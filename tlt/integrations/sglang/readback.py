"""The drafter-push guard's read-back inside SGLang: draft-model weights by name.

Owns the one thing SGLang's ``get_weights_by_name`` lacks for TLT's hard check: in 0.5.12 and
0.5.23 it reads only the target model (``tp_worker``; no selector on the request). TLT's plugin
hooks the scheduler's handler (AROUND, both versions: :mod:`.hooks`) so that a name
``tlt.draft/<name>`` is read from the draft model instead, as the first ``truncate_size`` values of
that parameter, flattened (float); every other name goes to SGLang's own code unchanged. A server
without a draft model answers an empty list.
"""

from __future__ import annotations

from typing import Any

PREFIX = "tlt.draft/"


def draft_models(draft_worker: Any) -> list:
    """The draft model(s) of an SGLang speculative worker (0.5.23 workers with
    ``weight_update_runners``; 0.5.12's EAGLEWorkerV2, the default for EAGLE with the overlap
    scheduler, through its draft worker's ``draft_runner``; 0.5.12's EAGLEWorker); [] for none (NGRAM,
    no speculation)."""
    if draft_worker is None:
        return []
    runners = getattr(draft_worker, "weight_update_runners", None)
    if callable(runners):
        return [r.model for _, r in runners()]
    inner = getattr(draft_worker, "draft_worker", None)  # (a V2 worker holds no runner of its own)
    runner = (getattr(inner, "draft_runner", None) or getattr(draft_worker, "draft_model_runner", None)
              or getattr(draft_worker, "model_runner", None))
    return [runner.model] if runner is not None else []


def read(models: list, name: str, truncate_size: int) -> list[float]:
    """The first ``truncate_size`` values of the draft parameter ``name`` ([] if absent)."""
    for model in models[:1]:
        params = dict(model.named_parameters())
        if name in params:
            return params[name].detach().flatten()[:truncate_size].float().cpu().tolist()
    return []


def around_get_weights_by_name(original, self, recv_req, *args, **kwargs):
    """AROUND the scheduler's ``get_weights_by_name`` (0.5.12: ``self`` is the Scheduler; 0.5.23:
    its ``SchedulerWeightUpdaterManager``); both hold ``draft_worker``."""
    name = getattr(recv_req, "name", "")
    if not name.startswith(PREFIX):
        return original(self, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import GetWeightsByNameReqOutput

    values = read(draft_models(getattr(self, "draft_worker", None)), name[len(PREFIX):],
                  int(getattr(recv_req, "truncate_size", 100)))
    return GetWeightsByNameReqOutput(parameter=values)
