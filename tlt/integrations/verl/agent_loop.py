"""Agent loop ``tlt_agent``: verl's single-turn agent loop with a request seed in its sampling params.

Owns :class:`TLTAgentLoop` (``actor_rollout_ref.rollout.agent.default_agent_loop=tlt_agent``, set
by the ``tlt_grpo`` configs). verl 0.9.1 gives a rollout request no seed, so TLT derives one from
the request's identity (:func:`tlt.drafter.seeds.request_seed`: ``data.seed``, the
global step, the prompt's dataset index, the sample's index in its group, training vs validation,
the prompt) and carries it in ``sampling_params["seed"]``, which the tlt rollout honours: the same
request samples the same tokens whether speculation is on or off. Training batches carry a marker
(:data:`TRAIN_KEY`, set by the tlt trainer); validation batches do not. Its server client follows a
request that consolidation moves between replicas (:class:`~tlt.integrations.verl.moves.MovingClient`).
In a short round of tail batching, each response reports its end (finished or dropped, when, how
many tokens) to the driver (:mod:`tlt.integrations.verl.tail_round`) before verl stores it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from tlt.drafter.seeds import request_seed
from tlt.integrations.verl.moves import MovingClient
from tlt.integrations.verl.requests import plain
from tlt.integrations.verl.tail_batching import DROPPED, MARKERS, SHORT_ROUND_KEY

log = logging.getLogger(__name__)
NAME = "tlt_agent"
TRAIN_KEY = "tlt_train"  # present (True) on the tlt trainer's training batches only


@register(NAME)
class TLTAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> Any:
        if "session_id" in kwargs and "index" in kwargs and "global_steps" in kwargs:
            seed = request_seed(data_seed=int(self.config.data.get("seed", 0) or 0),
                                step=int(kwargs["global_steps"]), index=int(kwargs["index"]),
                                sample=int(kwargs["session_id"]), validate=not kwargs.get(TRAIN_KEY, False),
                                prompt=plain(kwargs.get("raw_prompt")))
            sampling_params = {**sampling_params, "seed": seed}
        else:  # verl's legacy (non-TransferQueue) agent loop has no sample index: no seed
            log.warning("tlt_agent: request without session_id/index/global_steps: sampled without a seed")
        if not isinstance(self.server_manager, MovingClient):  # a request consolidation moves: one answer
            self.server_manager = MovingClient(self.server_manager)
        out = await super().run(sampling_params, **kwargs)
        if kwargs.get(SHORT_ROUND_KEY):
            await self._report_end(out, kwargs)
        return out

    async def _report_end(self, out: Any, kwargs: dict) -> None:
        """Tail batching's short round: this response's end (finished or dropped, when, how long)
        goes to the driver (:mod:`tlt.integrations.verl.tail_round`) before verl stores it."""
        import transfer_queue as tq

        dropped = self.server_manager.stop_reason == DROPPED  # never trained: the driver clears its row
        await tq.async_kv_put(key=f"{kwargs['uid']}_{int(kwargs['session_id'])}", partition_id=MARKERS,
                              tag={"dropped": dropped, "t": time.time(), "length": len(out.response_ids)})

