"""HTTP bodies of SGLang's endpoints as SGLang's own request objects (test harness: the recording
server of push_check.py and the stand-in server of standin.py). Import after cpu_env.activate."""

from __future__ import annotations

import base64
import dataclasses


def request_class(endpoint: str):
    """SGLang's request class for ``endpoint`` (None: an endpoint without a body class here)."""
    from sglang.srt.managers import io_struct as io

    return {"generate": io.GenerateReqInput,
            "update_weights_from_tensor": io.UpdateWeightsFromTensorReqInput,
            "begin_weight_update": getattr(io, "BeginWeightUpdateReqInput", None),
            "end_weight_update": getattr(io, "EndWeightUpdateReqInput", None),
            "pause_generation": io.PauseGenerationReqInput,
            "continue_generation": io.ContinueGenerationReqInput,
            "abort_request": io.AbortReq,
            "release_memory_occupation": io.ReleaseMemoryOccupationReqInput,
            "resume_memory_occupation": io.ResumeMemoryOccupationReqInput,
            "get_weights_by_name": io.GetWeightsByNameReqInput,
            "add_external_corpus": getattr(io, "AddExternalCorpusReqInput", None),
            "remove_external_corpus": getattr(io, "RemoveExternalCorpusReqInput", None)}.get(endpoint)


def parse(endpoint: str, body: dict):
    """The body as SGLang's own request object (raises on a field it does not have)."""
    cls = request_class(endpoint)
    if cls is None:
        return None
    if endpoint == "update_weights_from_tensor" and not dataclasses.is_dataclass(cls):  # 0.5.23: bytes
        body = {**body, "serialized_named_tensors": [base64.b64decode(x) for x in body["serialized_named_tensors"]]}
    return cls(**body)


def tensors(body: dict) -> dict:
    """name -> tensor carried by an update_weights_from_tensor body (TP rank 0's part), copied."""
    from sglang.srt.utils import MultiprocessingSerializer

    raw = base64.b64decode(body["serialized_named_tensors"][0])
    return {name: MultiprocessingSerializer.deserialize(local.values[0]).clone()
            for name, local in MultiprocessingSerializer.deserialize(raw)}
