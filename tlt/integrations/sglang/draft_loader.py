"""Draft-only weight loading for SGLang 0.5.12, whose weight updates have no ``selector``.

Owns :func:`load_draft_only`, a custom weight loader: launch the server with
``--custom-weight-loader tlt.integrations.sglang.draft_loader.load_draft_only`` and post
``update_weights_from_tensor`` with that path as ``load_format`` (``TLTSGLangServerAdapter.
update_draft_weights`` does). SGLang 0.5.12 then calls the loader on every TP worker, first with
the draft model, then with the target model (EAGLE worker); it loads the tensors into the draft
model and leaves the target untouched. SGLang's draft models are its ``*Eagle`` / ``*Eagle3``
classes (``LlamaForCausalLMEagle``, ``Qwen2ForCausalLMEagle``, ...).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def is_draft_model(model) -> bool:
    return "Eagle" in type(model).__name__


def load_draft_only(model, named_tensors) -> None:
    """SGLang's custom-loader signature: ``(model, [(name, tensor), ...])``."""
    if not is_draft_model(model):
        log.debug("draft-only push: target model %s left untouched", type(model).__name__)
        return
    model.load_weights(list(named_tensors))
