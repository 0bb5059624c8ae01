"""The one interface the ``tlt`` trainer's loop drives a rollout replica through.

Owns the contract, not an implementation. The trainer, the actor workers and the drafter pusher
(:mod:`tlt.integrations.verl.drafter_push`) call these methods on each replica's Ray actor and
nothing else, so the CPU tests of the loop exercise the code GPU users run once a second backend
implements it. Implementations: the project's engine
(:class:`tlt.integrations.verl.server.TLTServer`) and SGLang
(:class:`tlt.integrations.verl.sglang_server.TLTSGLangServer`).
``tests/tlt/test_replica_api.py`` checks that every implementation has every method, with these
parameter names.
"""

from __future__ import annotations

from typing import Any, Protocol


class ReplicaAPI(Protocol):
    # ------------------------------------------------------------------ verl's server interface
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, **kwargs) -> Any:
        """One request's tokens and log-probs (verl's ``TokenOutput``)."""

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        """Abort one request: its ``generate`` returns its partial output with stop reason
        ``aborted``. Returns ``{"aborted": bool, "request_id": ...}``."""

    async def drop_requests(self) -> int:
        """Tail batching's drop: every request in flight returns its partial output with stop
        reason ``tlt_dropped`` (verl's client does not resubmit it), and requests arriving until
        ``resume_generation`` return at once, dropped. Returns the requests dropped."""

    async def resume_generation(self) -> None:
        """Accept requests again (after a drop, or verl's own abort)."""

    def update_weights(self, state: dict, version: int | None = None) -> int:
        """Policy push: target weights only, never into the drafter; returns tensors written."""

    async def release_kv_cache(self) -> None:
        """Give the serving memory back (around spot training and verl's sleep)."""

    async def resume_kv_cache(self) -> None:
        """Take the serving memory again before the replica is needed."""

    # ------------------------------------------------------------------ the loop's own calls
    def begin_step(self, step: int) -> None:
        """A rollout begins: reset the step's statistics; a running spot session is stopped."""

    async def end_rollout(self) -> None:
        """The rollout ended, before verl sleeps the replica: training stopped, memory the loop
        released taken back (verl's sleep finds it as verl left it)."""

    def step_stats(self) -> dict[str, Any]:
        """This step's counters: verifies, committed, EAGLE-only verifies, arms, idle time,
        spot sessions (with each one's held-out accept length), the drafter version served."""

    async def load_drafter(self, version: int, step: int | None = None) -> int:
        """Drafter push: serve spot checkpoint ``step`` (draft weights only) as ``version``."""

    async def served_drafter(self) -> dict[str, Any]:
        """The push guard's hard check: ``{"digest": ..., "dtype": ...}`` of the draft weights
        actually served (digest None: no drafter)."""

    async def rollback_drafter(self, version: int) -> int:
        """Serve again the drafter served before the last push, as ``version``."""

    def tuner_state(self) -> dict[str, Any] | None:
        """The engine's tuner statistics (JSON-able; None: this replica has no tuner of ours)."""

    def load_tuner_state(self, state: dict[str, Any] | None) -> bool:
        """Take back :meth:`tuner_state` output (a resumed run); False when it does not fit the
        tuner this replica runs now (then it starts afresh)."""

    def add_samples(self, step: int, samples: list[tuple]) -> int:
        """DataBuffer feed from the actor's old-log-prob capture; returns samples kept."""

    async def add_history(self, step: int, pairs: list[tuple[list[int], list[int]]]) -> int:
        """Step ``step``'s (prompt, response) pairs become model-free draft sources."""

    def shutdown(self) -> None:
        """Stop the spot agent and leave nothing running."""
