"""Trainer mode ``tlt``: verl's sync GRPO trainer with TLT's hooks around the rollout.

Owns :class:`TLTTrainer` (``trainer.v1.trainer_mode=tlt``), derived from verl's sync trainer and
pinned to its semantics. With ``tlt.enable=false`` none of the hooks below run. The replicas are
the project's engine (``rollout.name=tlt``) or SGLang (``rollout.name=sglang``:
:mod:`.sglang_server`), both behind :mod:`tlt.integrations.replica_api`. Per RL step:

- ``prepare_step`` (rollout begins): the coordinator learns the step; replicas reset their stats;
- replicas report IDLE when their requests drain, the coordinator promotes them, they spot-train
  the drafter (:mod:`tlt.integrations.verl.server`);
- ``on_sample_end`` (rollout ends): ``rollout_done`` preempts training (bounded wait), each
  replica ends its rollout (memory it released for training taken back) and its stats are
  collected; then verl sleeps the replicas;
- training batches: each prompt's requests get seeds from their identity (the ``tlt_agent`` loop),
  a duplicate (index, prompt) is refused, and the batch is put in a canonical order (prompt index,
  sample index) before verl balances it, so equal responses give equal updates whatever order
  they arrived in;
- the replicas feed their DataBuffers from the rollout (``tlt.buffer.capture=rollout``), or
  ``_compute_old_log_prob`` has the actor workers capture hidden states (``old_log_prob``);
- ``on_step_end``: verl pushes the policy (target only), then the last drafter push is judged on
  the rollout it served and a newer drafter goes to every replica (draft only, versioned, checked
  and rolled back on failure: :mod:`.drafter_push`); TLT metrics join verl's (``_pending_sync_metrics``);
- ``_compute_metrics``: one JSON line per step (``tlt report`` plots them) and one per response
  (``tlt_responses.jsonl``: step, prompt index, sample index, a hash of its tokens).

The coordinator runs as a child process of the trainer (a crash of either is survivable by the
other): its address, the rendezvous ports and the checkpoint directory reach the replicas through
:mod:`tlt.integrations.verl.runtime`.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import ray

from tlt.integrations.verl import resume, runtime
from tlt.integrations.verl.config import TLTConfig, from_verl
from tlt.integrations.verl.drafter_push import DrafterPusher
from tlt.integrations.verl.history_log import HISTORY_FILE, HistoryLog
from tlt.integrations.verl.spot_wiring import PORT_SPAN
from tlt.integrations.verl.step_stats import replica_fields
from tlt.integrations.verl.tail_mover import TailMover
from tlt.integrations.verl.verl_checks import check_verl_config, raise_if_registration_failed
from tlt.ports import free_port
from tlt.push_guard import GuardConfig

log = logging.getLogger(__name__)


def trainer_class():
    from verl.trainer.ppo.v1 import register_trainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils.debug import marked_timer

    from tlt.integrations.verl.worker import worker_class

    @register_trainer("tlt")
    class TLTTrainer(PPOTrainerSync):
        def __init__(self, config):
            raise_if_registration_failed()
            self.tlt = from_verl(config)
            check_verl_config(config, self.tlt)
            _route_groups(config, self.tlt)
            self._sglang = self.tlt.enable and config.actor_rollout_ref.rollout.name == "sglang"
            if self._sglang:  # this run's SGLang replicas are TLT's (verl's registry, this process only)
                from verl.workers.rollout.replica import RolloutReplicaRegistry

                RolloutReplicaRegistry.register("sglang", _sglang_replica)
            super().__init__(config)
            self._coord_proc = None
            self._driver = None
            self._pusher = DrafterPusher(self._servers, GuardConfig(
                fraction=self.tlt.drafter.guard_fraction, min_verifies=self.tlt.drafter.guard_min_verifies))
            self._aux_layers = None
            self._uid_index: dict[str, int] = {}  # prompt uid -> dataset index, this step's batch
            self._history_log: HistoryLog | None = None  # the replicas' draft history, for restarts
            self._mover: TailMover | None = None
            self._tail: dict = {}
            self._lengths: list[int] = []  # the last rollout's response lengths (the mover's estimate)
            self._failures: collections.Counter = collections.Counter()  # swallowed failures, by what failed
            self._checkpointed = -1  # the step verl saved last (its TLT state follows at the step's end)
            self._resumed_from: Path | None = None  # verl's global_step_N folder this run resumed from
            self._resume_info: dict | None = None  # what the resume restored, for the first step's record
            self._rounds = None  # tail batching (tlt.integrations.verl.tail_round), built with the dataloader
            self._rounds_state: dict | None = None  # its checkpointed state, until it is built
            if not self.tlt.enable:
                return
            tc = self.tlt.tail.consolidate
            if tc.mode != "off":
                self._mover = TailMover(self._servers, tc.policy(self.tlt.engine.max_batch),
                                        interval_s=tc.interval_s, move_s=tc.move_s)
                self._step_requests = int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
            self.replay_buffer.poll_interval = self.tlt.replay_poll_s
            self._setup_runtime(config)

        # -------------------------------------------------------------- set-up
        def _setup_runtime(self, config) -> None:
            from tlt.coordinator import DriverClient

            out = Path(config.trainer.default_local_dir)
            out.mkdir(parents=True, exist_ok=True)
            spot_root = self.tlt.spot.checkpoint_dir or str(out / "tlt_spot")
            self._record_path = Path(self.tlt.record_path or out / "tlt_steps.jsonl")
            self._responses_path = self._record_path.with_name("tlt_responses.jsonl")
            self._record_path.parent.mkdir(parents=True, exist_ok=True)
            node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            address = None
            n_replicas = max(1, config.trainer.n_gpus_per_node * config.trainer.nnodes)
            train = self.tlt.drafter.train and self.tlt.coordinator.enable
            if train:
                address = f"tcp://{node_ip}:{free_port()}"
                cc = self.tlt.coordinator
                with open(out / "tlt_coordinator.log", "ab") as log_file:
                    self._coord_proc = subprocess.Popen(
                        [sys.executable, "-m", "tlt.coordinator", "--bind", address,
                         "--heartbeat-ms", str(int(cc.heartbeat_s * 1000)), "--liveness", str(cc.liveness),
                         "--idle-threshold", str(self.tlt.spot.min_idle),
                         "--stop-timeout-s", str(cc.done_timeout_s), "--exit-with-parent"],
                        stdout=log_file, stderr=log_file)
                weakref.finalize(self, _stop_process, self._coord_proc)  # also when init fails
                (out / "tlt_coordinator.pid").write_text(f"{self._coord_proc.pid}\n")
                self._driver = DriverClient(address, timeout_s=cc.done_timeout_s)
                self._aux_layers = _feature_layers(self.tlt, config.actor_rollout_ref.model.path) or None
            base = (self.tlt.spot.base_port or free_port(PORT_SPAN * n_replicas)) if train else 0
            seed = int(config.actor_rollout_ref.rollout.get("seed", 0) or 0)
            start = None
            if self._sglang and self.tlt.sglang.algorithm == "eagle":
                from tlt.integrations.sglang.launch import start_drafter

                start = str(start_drafter(self.tlt, config.actor_rollout_ref.model.path, out / "tlt_sglang_drafter",
                                          seed=seed))
            runtime.publish(runtime.Runtime(tlt=self.tlt, coordinator_address=address,
                                            spot_root=spot_root, run_dir=str(out), spot_base_port=base,
                                            seed=seed, start_drafter=start))
            log.info("tlt: coordinator %s, spot checkpoints %s, step records %s", address, spot_root,
                     self._record_path)

        def _build_replay_buffer(self):
            self.trainer_mode = "sync"  # a custom mode name would get async semantics in verl
            return super()._build_replay_buffer()

        def _init_resource_pool_mgr(self):
            out = super()._init_resource_pool_mgr()
            if self.tlt.enable:  # the actor roles only (a critic keeps its own worker class)
                from verl.trainer.ppo.utils import Role

                cls = ray.remote(worker_class())
                for role in (Role.ActorRollout, Role.ActorRolloutRef, Role.Actor):
                    if role in self.role_worker_mapping:
                        self.role_worker_mapping[role] = cls
            return out

        # -------------------------------------------------------------- request identity and order
        def _next_train_batch(self, num_prompts=None):
            if not self.tlt.enable:
                return super()._next_train_batch(num_prompts)
            batch = (self._rounds.batch(self.global_steps) if self._rounds is not None
                     else super()._next_train_batch(num_prompts))
            from verl.utils import tensordict_utils as tu

            from tlt.integrations.verl.agent_loop import TRAIN_KEY
            from tlt.integrations.verl.requests import duplicate_requests

            index = [int(i) for i in _as_list(batch["index"])]
            dups = duplicate_requests(index, _as_list(batch["raw_prompt"]))
            if dups:
                i, prompt = dups[0]
                raise ValueError(f"step {self.global_steps}: dataset index {i} with the same prompt appears "
                                 f"{index.count(i)} times in one batch ({prompt[:80]}...): its samples would share "
                                 "seeds and give identical responses (zero GRPO advantages); give every row a "
                                 "unique extra_info.index or remove duplicate prompts")
            self._uid_index.update(zip(_as_list(batch["uid"]), index))
            tu.assign_non_tensor_data(batch, TRAIN_KEY, True)
            return batch

        def _balance_batch(self, batch, metrics, *args, **kwargs):
            if self.tlt.enable and batch.partition_id == "train":
                if self._rounds is not None:  # only the round's trained responses, R0 per prompt
                    self._rounds.check([k for k, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding")])
                batch.reorder(canonical_order(list(batch.keys), self._uid_index))
            return super()._balance_batch(batch, metrics, *args, **kwargs)

        def _step_responses(self, batch) -> tuple[list[str], list[list[int]], list[list[int]]]:
            """The step's (keys, prompts, responses), padding rows left out."""
            import transfer_queue as tq

            keys = [k for k, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding", False)]
            data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["prompts", "responses"])
            prompts = [[t for t in row if t >= 0] for row in data["prompts"].to_padded_tensor(padding=-1).tolist()]
            responses = [[t for t in row if t >= 0] for row in data["responses"].to_padded_tensor(padding=-1).tolist()]
            return keys, prompts, responses

        def _record_responses(self, keys: list[str], responses: list[list[int]], step: int) -> None:
            """One line per response: step, prompt index, sample index, length, token hash."""
            with open(self._responses_path, "a") as f:
                for key, toks in zip(keys, responses):
                    uid, sample, _ = key.rsplit("_", 2)
                    f.write(json.dumps({"step": step, "index": self._uid_index.get(uid, -1), "sample": int(sample),
                                        "length": len(toks), "sha1": hashlib.sha1(
                                            json.dumps(toks).encode()).hexdigest()}) + "\n")

        def _push_history(self, prompts: list[list[int]], responses: list[list[int]], step: int) -> None:
            """The step's (prompt, response) pairs go to every replica's draft history and to the run
            directory (:class:`~tlt.integrations.verl.history_log.HistoryLog`, for a replica that restarts)."""
            hist = self.tlt.speculation.history_config()
            if hist is None or not (self.tlt.speculation.ngram and self.tlt.speculation.enable):
                return
            pairs = list(zip(prompts, responses))
            ray.get([s.add_history.remote(step, pairs) for s in self._servers()], timeout=120)
            if self._history_log is None:
                self._history_log = HistoryLog(self._record_path.with_name(HISTORY_FILE), hist)
            self._history_log.add(step, pairs)

        # -------------------------------------------------------------- checkpoints (tlt.integrations.verl.resume)
        def _save_checkpoint(self):
            if self._rounds is not None:  # before verl's tracker file names this step (a resume finds it)
                resume.save_rounds(self._step_folder(self.global_steps), self._rounds.state())
            out = super()._save_checkpoint()
            self._checkpointed = self.global_steps
            return out

        def _load_checkpoint(self):
            out = super()._load_checkpoint()
            if self.global_steps > 0:
                mode, path = self.config.trainer.resume_mode, self.config.trainer.resume_from_path
                self._resumed_from = (Path(path).absolute() if mode == "resume_path"
                                      else self._step_folder(self.global_steps))
                if self.tlt.enable and self.tlt.tail.batching.enable:
                    self._rounds_state = resume.load_rounds(self._resumed_from)
            return out

        def _tail_rounds(self):
            """Tail batching's driver over verl's dataloader (built at the first step: the dataloader
            and a resumed run's position exist by then)."""
            from tlt.integrations.verl.tail_round import RoundDriver

            def fetch():
                try:
                    if self.train_dataloader_it is None:
                        self.train_dataloader_it = iter(self.train_dataloader)
                    return next(self.train_dataloader_it)
                except StopIteration:
                    self.train_dataloader_it = iter(self.train_dataloader)
                    return next(self.train_dataloader_it)

            rounds = RoundDriver(self.tlt.tail.batching, p0=int(self.config.data.train_batch_size),
                                 r0=int(self.config.actor_rollout_ref.rollout.n),
                                 fetches_per_epoch=len(self.train_dataloader), fetch=fetch, servers=self._servers,
                                 poll_s=self.tlt.replay_poll_s)
            if self._rounds_state is not None:
                rounds.restore(self._rounds_state)
            elif self.global_steps > 1:  # resumed from a run without tail batching: its steps each fetched one batch
                rounds.batcher.fetched = (self.global_steps - 1) % len(self.train_dataloader)
                log.warning("tlt: the checkpoint holds no tail batching state (saved without it): tail batching "
                            "starts at the epoch's batch %d", rounds.batcher.fetched)
            return rounds

        def on_init_end(self):
            out = super().on_init_end()  # the checkpoint's policy pushed: the replicas can serve
            if self.tlt.enable and self._resumed_from is not None:
                spot = runtime.current().spot_root
                self._resume_info = resume.restore(self._resumed_from, self._pusher, self._servers, spot,
                                                   self._history_path(), self._replay_history)
            return out

        def _step_folder(self, step: int) -> Path:
            return Path(self.config.trainer.default_local_dir).absolute() / f"global_step_{step}"

        def _history_path(self) -> Path | None:
            return self._record_path.with_name(HISTORY_FILE) if hasattr(self, "_record_path") else None

        def _replay_history(self, step: int, pairs: list) -> None:
            ray.get([s.add_history.remote(step, pairs) for s in self._servers()], timeout=120)

        def _servers(self) -> list:
            return [r.servers[0] for r in self.llm_server_manager.get_replicas()]

        # -------------------------------------------------------------- hooks
        def prepare_step(self):
            if self.tlt.enable:
                step = self.global_steps
                if self._driver is not None and not self._driver.step_begin(step, timeout_s=2.0):
                    log.warning("tlt: the coordinator did not answer step_begin(%d): rollout goes on "
                                "without drafter adaptation", step)
                ray.get([s.begin_step.remote(step) for s in self._servers()])
                requests = getattr(self, "_step_requests", 0)
                if self.tlt.tail.batching.enable:
                    if self._rounds is None:
                        self._rounds = self._tail_rounds()
                    requests = self._rounds.plan().requests
                self._t_rollout = time.monotonic()
                if self._mover is not None:
                    self._mover.start(requests, self._lengths)
            return super().prepare_step()

        def on_sample_begin(self):
            out = super().on_sample_begin()
            if self._rounds is not None:  # a short round ends once its first P0 prompts finish
                self._rounds.before_sample(self._mover.stop if self._mover is not None else None)
            return out

        def on_sample_end(self):
            if self.tlt.enable:
                step = self.global_steps
                self._t_rollout_end = time.monotonic()
                self._rollout_s = self._t_rollout_end - self._t_rollout
                self._tail = self._mover.stop() if self._mover is not None else {}
                with marked_timer("tlt_preempt", self.timing_raw):
                    self._outcome = (self._driver.rollout_done(step) if self._driver is not None else None)
                if self._outcome is not None and not self._outcome.reachable:
                    log.warning("tlt: coordinator unreachable at the end of step %d's rollout: "
                                "drafter training could not be stopped through it", step)
                self._end_rollout()
                self._stats = self._collect_stats()
                self._lengths = [n for s in self._stats for n in s.get("lengths", ())]
            return super().on_sample_end()

        def _end_rollout(self) -> None:
            """Before verl sleeps the replicas: training stopped, memory TLT released taken back."""
            for i, s in enumerate(self._servers()):
                try:
                    ray.get(s.end_rollout.remote(), timeout=120)
                except Exception as e:  # a replica died: verl's own calls will find out
                    log.warning("tlt: replica %d did not end its rollout (%r)", i, e)

        def _collect_stats(self) -> list[dict]:
            out = []
            for i, s in enumerate(self._servers()):
                try:
                    out.append(ray.get(s.step_stats.remote(), timeout=60))
                except Exception as e:  # a replica died: its step is lost, the run goes on
                    log.warning("tlt: replica %d gave no statistics (%r)", i, e)
            return out

        def _compute_old_log_prob(self, batch, metrics):
            # Features are only worth capturing when something trains on them.
            if self._driver is not None and self.tlt.buffer.capture == "old_log_prob":
                with marked_timer("tlt_capture_arm", self.timing_raw):
                    self.actor_rollout_wg.tlt_arm_capture(self.global_steps, self._aux_layers)
            return super()._compute_old_log_prob(batch, metrics)

        def on_step_end(self):
            out = super().on_step_end()  # policy push: target weights only
            if not self.tlt.enable:
                return out
            with marked_timer("tlt_drafter_push", self.timing_raw):  # guarded: tlt.push_guard
                self._pusher.step_end(runtime.current().spot_root, self._stats)
            if self._checkpointed == self.global_steps:  # after the push: what step N + 1 serves
                with marked_timer("tlt_save_checkpoint", self.timing_raw):
                    counted(self._failures, "checkpoint", resume.save, self._step_folder(self.global_steps),
                            self._pusher, self._servers, runtime.current().spot_root, self._history_path())
            self._pending_sync_metrics = {**(getattr(self, "_pending_sync_metrics", None) or {}),
                                          **self._metrics()}
            return out

        def _feeds_dropped(self) -> int:
            """Captured feature batches the actor workers could not hand to their replica (cumulative)."""
            if self.tlt.buffer.capture != "old_log_prob" or self._driver is None:
                return 0
            try:
                return int(sum(self.actor_rollout_wg.tlt_dropped_feeds()))
            except Exception:  # a worker died: verl's own calls will find out
                log.exception("tlt: could not read the workers' dropped feeds")
                return 0

        def _metrics(self) -> dict:
            st = self._stats
            verifies = sum(s["verifies"] for s in st)
            committed = sum(s["committed"] for s in st)
            accepted = sum(s["accepted"] for s in st)
            drafted = sum(s["drafted"] for s in st)
            tokens = sum(s["tokens"] for s in st)
            losses = [x for s in st for x in s["losses"]]
            arms, arm_verifies, arm_committed = collections.Counter(), collections.Counter(), collections.Counter()
            for s in st:
                arms.update(s["arms"])
                arm_verifies.update(s.get("arm_verifies", {}))
                arm_committed.update(s.get("arm_committed", {}))
            n_arms = sum(arms.values()) or 1
            m = {
                # NaN when nothing was verified (speculation off all step): no accept length, not 0
                "rollout/spec_accept_length": committed / verifies if verifies else float("nan"),
                "rollout/spec_accept_rate": accepted / drafted if drafted else float("nan"),
                "tlt/spec_verifies": float(verifies),
                "tlt/spec_committed": float(committed),
                "tlt/drafter_version": float(self._pusher.version),
                "tlt/drafter_push_rejected": float(self._pusher.guard.rejected),
                "tlt/drafter_repushed": float(self._pusher.repushed),
                "tlt/drafter_loss": statistics.fmean(losses) if losses else float("nan"),
                "tlt/spot_train_steps": float(sum(s["train_steps"] for s in st)),
                "tlt/idle_replica_s": float(sum(s["idle_s"] for s in st)),
                "tlt/sd_token_share": min(1.0, committed / tokens) if tokens else 0.0,
                "tlt/buffer_samples": float(sum(s["buffer"]["samples"] for s in st)),
                "tlt/rollout_s": self._rollout_s,
                "tlt/sessions": float(sum(s["sessions"] for s in st)),
                "tlt/tail_moves": float(self._tail.get("moves", 0)),
                # a paged cache out of blocks: requests evicted, and their tokens prefilled again
                "tlt/evicted": float(sum(s["lifecycle"].get("evicted", 0) for s in st)),
                "tlt/recomputed_tokens": float(sum(s.get("recomputed", 0) for s in st)),
                # the KV positions the fullest replica held at its peak, over a static cache of its batch
                "tlt/kv_peak_share": max((s.get("kv_peak_positions", 0) / (s["kv_peak_batch"] * s["kv_slots"])
                                          for s in st if s.get("kv_peak_batch") and s.get("kv_slots")), default=0.0),
                # failures the run went on after (cumulative): a lost draft source shows here, not only in a log
                "tlt/history_push_failures": float(self._failures["history"] + self._failures["responses"]),
                "tlt/response_record_failures": float(self._failures["record"] + self._failures["responses"]),
                "tlt/feeds_dropped": float(self._feeds_dropped()),
                "tlt/checkpoint_failures": float(self._failures["checkpoint"]),  # TLT state not saved with verl's
            }
            if self._rounds is not None:  # tail batching: prompts waiting for a long round, tokens dropped
                m["tlt/tail_queue"] = float(self._rounds.record.get("queued_after", 0))
                m["tlt/tail_dropped_share"] = float(self._rounds.record.get("dropped_share", 0.0))
            drift = [s["drift_top1"] for s in st if s["drift_top1"] is not None]
            if drift:  # 1 - top-1 agreement of the policies before and after the last update
                m["tlt/target_drift"] = 1.0 - statistics.fmean(drift)
            m.update({f"tlt/arm_share/{a}": n / n_arms for a, n in arms.items()})
            # per arm (strategy@proposer): the summary compares drafters at the same strategy
            m.update({f"tlt/arm_verifies/{a}": float(n) for a, n in arm_verifies.items()})
            m.update({f"tlt/arm_committed/{a}": float(n) for a, n in arm_committed.items()})
            suffix = sum(n for a, n in arms.items() if a.endswith("@suffix"))
            if arms:  # which proposer drafted the speculative steps
                m["tlt/proposer_share/suffix"] = suffix / n_arms
                m["tlt/proposer_share/eagle"] = 1.0 - suffix / n_arms
            o = self._outcome
            self._step_extra = {"stopped": list(o.stopped) if o else [], "lost": list(o.lost) if o else [],
                                "timed_out": list(o.timed_out) if o else [], "coordinator_reachable":
                                bool(o.reachable) if o else False,
                                "preempt_s": [x for s in st for x in s["preempt_s"]],
                                "spot_phase_s": [list(x) for s in st for x in s["phases"]],
                                "proposers": [s["proposer"] for s in st], "tail": self._tail,
                                "buffer_fed": [s.get("buffer_fed", {}) for s in st],
                                "tail_batching": self._rounds.record if self._rounds is not None else None,
                                **replica_fields(st, self._t_rollout, self._t_rollout_end)}
            if self._resume_info is not None:  # the first step after a resume: what it restored
                self._step_extra["resumed"], self._resume_info = self._resume_info, None
            return m

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            out = super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
            if self.tlt.enable:
                rec = {"step": global_steps, **{k: v for k, v in metrics.items()
                                                if k.startswith(("tlt/", "rollout/spec", "timing_s/",
                                                                 "critic/score", "critic/rewards",
                                                                 "response_length/", "training/rollout_probs"))},
                       **getattr(self, "_step_extra", {})}
                with open(self._record_path, "a") as f:
                    f.write(json.dumps(rec, default=float) + "\n")
                got = counted(self._failures, "responses", self._step_responses, batch)
                if got is not None:  # a record or a draft source, not the run: the step goes on either way
                    keys, prompts, responses = got
                    counted(self._failures, "record", self._record_responses, keys, responses, global_steps)
                    counted(self._failures, "history", self._push_history, prompts, responses, global_steps)
                self._uid_index.clear()
            return out

        def fit(self, agent_loop_manager):
            try:
                return super().fit(agent_loop_manager)
            finally:
                self._shutdown()

        def _shutdown(self) -> None:
            if not self.tlt.enable:
                return
            try:
                ray.get([s.shutdown.remote() for s in self._servers()], timeout=30)
            except Exception:
                log.exception("tlt: replica shutdown")
            if self._driver is not None:
                self._driver.close()
            if self._coord_proc is not None:
                _stop_process(self._coord_proc)

    return TLTTrainer


def _sglang_replica():
    from verl.workers.rollout import replica as verl_replica

    verl_replica._load_sglang()  # verl's own loader first: what importing its SGLang server needs
    from tlt.integrations.verl.sglang_server import TLTSGLangReplica

    return TLTSGLangReplica


def counted(failures: collections.Counter, what: str, fn, *args):
    """``fn(*args)``; a failure is logged and counted under ``what`` (the run goes on), and gives None."""
    try:
        return fn(*args)
    except Exception:
        failures[what] += 1
        log.exception("tlt: %s failed (%d so far this run); the run goes on", what, failures[what])
        return None


def canonical_order(keys: list[str], uid_index: dict[str, int]) -> list[int]:
    """Positions of verl's trajectory keys (``{uid}_{sample}_{output}``) sorted by (prompt index,
    sample index, output index): an order that does not depend on arrival. uid_index: prompt uid ->
    dataset index (unknown uids sort first, by uid)."""
    def rank(k: str):
        uid, sample, out = k.rsplit("_", 2)
        return uid_index.get(uid, -1), int(sample), int(out), uid
    return sorted(range(len(keys)), key=lambda j: rank(keys[j]))


def _route_groups(config, cfg: TLTConfig) -> None:
    """Point verl at TLT's group router (configs/tlt_router.yaml) unless TLT is off, routing is off
    or the user configured a router of their own."""
    from omegaconf import open_dict

    import tlt.configs

    rollout = config.actor_rollout_ref.rollout
    if not (cfg.enable and cfg.route_groups) or rollout.get("router_config_path"):
        return
    with open_dict(rollout):
        rollout.router_config_path = str(Path(tlt.configs.__file__).with_name("tlt_router.yaml"))


def _as_list(x) -> list:
    """A batch column (tensor, numpy array or NonTensorStack) as a Python list."""
    if hasattr(x, "tolist"):
        return x.tolist()
    return [getattr(v, "data", v) for v in x]


def _stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _feature_layers(tlt: TLTConfig, model_path: str) -> list[int]:
    """The target layers the drafter reads besides the last hidden state (EAGLE-3's aux layers,
    none for EAGLE): the warm-up drafter's, else the method's defaults for this target."""
    from tlt.drafter.eagle import DrafterConfig, read_config
    from tlt.drafter.model_config import ModelConfig

    if tlt.drafter.init_path:
        return list(read_config(tlt.drafter.init_path).aux_layers)
    return list(DrafterConfig.for_target(ModelConfig.from_pretrained(model_path), tlt.drafter.method).aux_layers)

