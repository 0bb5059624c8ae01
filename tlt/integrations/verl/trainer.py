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

The trainer is thin: each concern is a component built in ``__init__`` (every attribute exists from
construction), and the hooks call them in verl's order:

    _coordinator  the coordinator child process and its client (:mod:`.coordinator_process`)
    _window       this step's rollout: its clock, the replicas' statistics (:mod:`.step_metrics`)
    _pusher       drafter versions, their guard and rollback (:mod:`.drafter_push`)
    _consolidator consolidation during the rollout (:mod:`.consolidator`), None when off
    _rounds       tail batching (:mod:`.tail_round`), built at the first step (it needs the dataloader)
    _resume       where the run stands against verl's checkpoints (:mod:`.resume`)
    _records      the run directory's records and the failures the run went on after (:mod:`.run_records`)

The coordinator's address, the rendezvous ports and the checkpoint directory reach the replicas
through :mod:`tlt.integrations.verl.runtime`. verl is imported at this module's top: the plugin
(:mod:`.plugin`) imports it from inside ``import verl``, after verl's trainer modules can load.
"""

from __future__ import annotations

import logging
from pathlib import Path

import ray
from verl.trainer.ppo.v1 import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug import marked_timer

from tlt.integrations.verl import resume, runtime
from tlt.integrations.verl.config import TLTConfig, from_verl
from tlt.integrations.verl.coordinator_process import CoordinatorProcess
from tlt.integrations.verl.drafter_push import DrafterPusher
from tlt.integrations.verl.requests import as_list, canonical_order, duplicate_requests
from tlt.integrations.verl.run_records import RunRecords
from tlt.integrations.verl.config import PORT_SPAN
from tlt.integrations.verl.spot_wiring import busy_timeout_s, spot_config
from tlt.integrations.verl.step_metrics import RolloutWindow, step_extra, step_metrics
from tlt.integrations.verl.consolidator import Consolidator
from tlt.integrations.verl.tail_round import RoundDriver
from tlt.integrations.verl.verl_checks import check_verl_config, raise_if_registration_failed
from tlt.ports import free_port
from tlt.push_guard import GuardConfig

log = logging.getLogger(__name__)


def trainer_class() -> type:
    """The ``tlt`` trainer (registered with verl when this module loads)."""
    return TLTTrainer


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
        out = Path(config.trainer.default_local_dir)
        self._coordinator = CoordinatorProcess()
        self._window = RolloutWindow()
        self._pusher = DrafterPusher(self._servers, GuardConfig(
            fraction=self.tlt.drafter.guard_fraction, min_verifies=self.tlt.drafter.guard_min_verifies))
        self._consolidator: Consolidator | None = None
        self._rounds: RoundDriver | None = None
        self._resume = resume.ResumePoint()
        self._records = RunRecords(Path(self.tlt.record_path or out / "tlt_steps.jsonl"), out)
        self._aux_layers: list[int] | None = None  # the target layers the actor workers capture
        self._uid_index: dict[str, int] = {}  # prompt uid -> dataset index, this step's batch
        self._step_requests = 0  # the rollout's requests (the consolidator's estimate)
        self._step_extra: dict = {}  # the step record's fields besides the metrics
        self._step_data: tuple | None = None  # the step's (keys, prompts, responses), read once by step()
        if not self.tlt.enable:
            return
        tc = self.tlt.tail.consolidate
        if tc.mode != "off":
            batch = self.tlt.engine.batch(config.actor_rollout_ref.rollout.get("max_num_seqs"))
            self._consolidator = Consolidator(self._servers, tc.rules(batch),
                                              interval_s=tc.interval_s, move_s=tc.move_s)
            self._step_requests = int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
        self.replay_buffer.poll_interval = self.tlt.replay_poll_s
        self._setup_runtime(config, out)

    # -------------------------------------------------------------- set-up
    def _setup_runtime(self, config, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        spot_root = self.tlt.spot.checkpoint_dir or str(out / "tlt_spot")
        self._records.steps_path.parent.mkdir(parents=True, exist_ok=True)
        node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        n_replicas = max(1, config.trainer.n_gpus_per_node * config.trainer.nnodes)
        train = self.tlt.drafter.train and self.tlt.coordinator.enable
        if train:
            self._coordinator.start(self.tlt, out, node_ip)
            self._aux_layers = _feature_layers(self.tlt, config.actor_rollout_ref.model.path) or None
        base = (self.tlt.spot.base_port or free_port(PORT_SPAN * n_replicas)) if train else 0
        seed = int(config.actor_rollout_ref.rollout.get("seed", 0) or 0)
        start = None
        if self._sglang and self.tlt.sglang.algorithm == "eagle":
            from tlt.integrations.sglang.launch import start_drafter

            start = str(start_drafter(self.tlt, config.actor_rollout_ref.model.path, out / "tlt_sglang_drafter",
                                      seed=seed))
        runtime.publish(runtime.Runtime(tlt=self.tlt, coordinator_address=self._coordinator.address,
                                        spot_root=spot_root, run_dir=str(out), spot_base_port=base,
                                        seed=seed, start_drafter=start))
        log.info("tlt: coordinator %s, spot checkpoints %s, step records %s", self._coordinator.address,
                 spot_root, self._records.steps_path)

    def _build_replay_buffer(self):
        self.trainer_mode = "sync"  # a custom mode name would get async semantics in verl
        return super()._build_replay_buffer()

    def _init_resource_pool_mgr(self):
        out = super()._init_resource_pool_mgr()
        if self.tlt.enable:  # the actor roles only (a critic keeps its own worker class)
            from verl.trainer.ppo.utils import Role

            from tlt.integrations.verl.worker import worker_class

            cls = ray.remote(worker_class())
            for role in (Role.ActorRollout, Role.ActorRolloutRef, Role.Actor):
                if role in self.role_worker_mapping:
                    self.role_worker_mapping[role] = cls
        return out

    def _servers(self) -> list:
        return [r.servers[0] for r in self.llm_server_manager.get_replicas()]

    # -------------------------------------------------------------- request identity and order
    def _next_train_batch(self, num_prompts=None):
        if not self.tlt.enable:
            return super()._next_train_batch(num_prompts)
        batch = (self._rounds.batch(self.global_steps) if self._rounds is not None
                 else super()._next_train_batch(num_prompts))
        from verl.utils import tensordict_utils as tu

        from tlt.integrations.verl.agent_loop import TRAIN_KEY

        index = [int(i) for i in as_list(batch["index"])]
        dups = duplicate_requests(index, as_list(batch["raw_prompt"]))
        if dups:
            i, prompt = dups[0]
            raise ValueError(f"step {self.global_steps}: dataset index {i} with the same prompt appears "
                             f"{index.count(i)} times in one batch ({prompt[:80]}...): its samples would share "
                             "seeds and give identical responses (zero GRPO advantages); give every row a "
                             "unique extra_info.index or remove duplicate prompts")
        self._uid_index.update(zip(as_list(batch["uid"]), index))
        tu.assign_non_tensor_data(batch, TRAIN_KEY, True)
        return batch

    def _balance_batch(self, batch, metrics, *args, **kwargs):
        if self.tlt.enable and batch.partition_id == "train":
            if self._rounds is not None:  # only the round's trained responses, R0 per prompt
                self._rounds.check([k for k, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding")])
            batch.reorder(canonical_order(list(batch.keys), self._uid_index))
        return super()._balance_batch(batch, metrics, *args, **kwargs)

    # -------------------------------------------------------------- checkpoints (tlt.integrations.verl.resume)
    def _save_checkpoint(self):
        if self._rounds is not None:  # before verl's tracker file names this step (a resume finds it)
            resume.save_rounds(self._step_folder(self.global_steps), self._rounds.state())
        out = super()._save_checkpoint()
        self._resume.checkpointed = self.global_steps
        return out

    def _load_checkpoint(self):
        out = super()._load_checkpoint()
        if self.global_steps > 0:
            mode, path = self.config.trainer.resume_mode, self.config.trainer.resume_from_path
            self._resume.folder = (Path(path).absolute() if mode == "resume_path"
                                   else self._step_folder(self.global_steps))
            if self.tlt.enable and self.tlt.tail.batching.enable:
                self._resume.rounds = resume.load_rounds(self._resume.folder)
        return out

    def on_init_end(self):
        out = super().on_init_end()  # the checkpoint's policy pushed: the replicas can serve
        if self.tlt.enable and self._resume.folder is not None:
            self._resume.restored = resume.restore(self._resume.folder, self._pusher, self._servers,
                                                   runtime.current().spot_root, self._records.history_path,
                                                   self._add_history)
        return out

    def _step_folder(self, step: int) -> Path:
        return Path(self.config.trainer.default_local_dir).absolute() / f"global_step_{step}"

    def _tail_rounds(self) -> RoundDriver:
        """Tail batching's driver over verl's dataloader (built at the first step: the dataloader
        and a resumed run's position exist by then)."""
        rounds = RoundDriver(self.tlt.tail.batching, p0=int(self.config.data.train_batch_size),
                             r0=int(self.config.actor_rollout_ref.rollout.n),
                             fetches_per_epoch=len(self.train_dataloader), fetch=self._fetch_batch,
                             servers=self._servers, poll_s=self.tlt.replay_poll_s)
        rounds.resume(self._resume.rounds, self.global_steps)
        return rounds

    def _fetch_batch(self):
        """The dataloader's next batch, a new epoch started when it runs out."""
        try:
            if self.train_dataloader_it is None:
                self.train_dataloader_it = iter(self.train_dataloader)
            return next(self.train_dataloader_it)
        except StopIteration:
            self.train_dataloader_it = iter(self.train_dataloader)
            return next(self.train_dataloader_it)

    # -------------------------------------------------------------- the rollout
    def prepare_step(self):
        if self.tlt.enable:
            step = self.global_steps
            self._coordinator.step_begin(step)
            ray.get([s.begin_step.remote(step) for s in self._servers()])
            requests = self._step_requests
            if self.tlt.tail.batching.enable:
                if self._rounds is None:
                    self._rounds = self._tail_rounds()
                requests = self._rounds.plan().requests
            self._window.begin()
            if self._consolidator is not None:
                self._consolidator.start(requests, self._window.lengths)
        return super().prepare_step()

    def on_sample_begin(self):
        out = super().on_sample_begin()
        if self._rounds is not None:  # a short round ends once its first P0 prompts finish
            self._rounds.before_sample(self._consolidator.stop if self._consolidator is not None else None)
        return out

    def on_sample_end(self):
        if self.tlt.enable:
            self._window.end()
            tail = self._consolidator.stop() if self._consolidator is not None else {}
            with marked_timer("tlt_preempt", self.timing_raw):
                outcome = self._coordinator.rollout_done(self.global_steps)
            self._end_rollout()
            self._window.collect(self._collect_stats(), outcome, tail)
        return super().on_sample_end()

    def _end_rollout(self) -> None:
        """Before verl sleeps the replicas: training stopped, memory TLT released taken back."""
        wait = busy_timeout_s(spot_config(self.tlt, 0)) + 60  # (a replica first waits out its session's stop)
        for i, s in enumerate(self._servers()):
            try:
                ray.get(s.end_rollout.remote(), timeout=wait)
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
        if self._coordinator.driver is not None and self.tlt.buffer.capture == "old_log_prob":
            with marked_timer("tlt_capture_arm", self.timing_raw):
                self.actor_rollout_wg.tlt_arm_capture(self.global_steps, self._aux_layers)
        return super()._compute_old_log_prob(batch, metrics)

    # -------------------------------------------------------------- the step's end
    def on_step_end(self):
        out = super().on_step_end()  # policy push: target weights only
        if not self.tlt.enable:
            return out
        spot_root = runtime.current().spot_root
        with marked_timer("tlt_drafter_push", self.timing_raw):  # guarded: tlt.push_guard
            self._pusher.step_end(spot_root, self._window.stats)
        if self._resume.checkpointed == self.global_steps:  # after the push: what step N + 1 serves
            with marked_timer("tlt_save_checkpoint", self.timing_raw):
                self._records.counted("checkpoint", resume.save, self._step_folder(self.global_steps),
                                      self._pusher, self._servers, spot_root, self._records.history_path)
        rounds = self._rounds.record if self._rounds is not None else None
        metrics = step_metrics(self._window, drafter_version=self._pusher.version,
                               drafter_spot_step=self._pusher.accepted or 0, push_rejected=self._pusher.guard.rejected,
                               repushed=self._pusher.repushed, failures=self._records.failures,
                               feeds_dropped=self._feeds_dropped(), rounds=rounds)
        self._step_extra = step_extra(self._window, rounds=rounds)
        restored = self._resume.take_restored()
        if restored is not None:  # the first step after a resume: what it restored
            self._step_extra["resumed"] = restored
        pending = getattr(self, "_pending_sync_metrics", None) or {}  # verl's, set once a step has run
        self._pending_sync_metrics = {**pending, **metrics}
        return out

    def _feeds_dropped(self) -> int:
        """Captured feature batches the actor workers could not hand to their replica (cumulative)."""
        if self.tlt.buffer.capture != "old_log_prob" or self._coordinator.driver is None:
            return 0
        try:
            return int(sum(self.actor_rollout_wg.tlt_dropped_feeds()))
        except Exception:  # a worker died: verl's own calls will find out
            log.exception("tlt: could not read the workers' dropped feeds")
            return 0

    def step(self, metrics, timing_raw):
        """verl's step; then its responses join the draft history, before the step's checkpoint
        (verl's, then TLT's in :meth:`on_step_end`) saves the history as of this step."""
        batch = super().step(metrics, timing_raw)
        self._step_data = None
        if self.tlt.enable:  # a record or a draft source, not the run: the step goes on either way
            self._step_data = self._records.counted("responses", self._step_responses, batch)
            if self._step_data is not None:
                _, prompts, responses = self._step_data
                self._records.counted("history", self._push_history, prompts, responses, self.global_steps)
        return batch

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        out = super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        if self.tlt.enable:
            self._records.write_step({"step": global_steps, **{
                k: v for k, v in metrics.items() if k.startswith((
                    "tlt/", "rollout/spec", "timing_s/", "critic/score", "critic/rewards", "response_length/",
                    "training/rollout_probs"))}, **self._step_extra})
            if self._step_data is not None:
                keys, _, responses = self._step_data
                self._records.counted("record", self._records.write_responses, keys, responses, global_steps,
                                      self._uid_index)
            self._uid_index.clear()
        return out

    def _step_responses(self, batch) -> tuple[list[str], list[list[int]], list[list[int]]]:
        """The step's (keys, prompts, responses), padding rows left out."""
        import transfer_queue as tq

        keys = [k for k, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding", False)]
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["prompts", "responses"])
        prompts = [[t for t in row if t >= 0] for row in data["prompts"].to_padded_tensor(padding=-1).tolist()]
        responses = [[t for t in row if t >= 0] for row in data["responses"].to_padded_tensor(padding=-1).tolist()]
        return keys, prompts, responses

    def _push_history(self, prompts: list[list[int]], responses: list[list[int]], step: int) -> None:
        """The step's (prompt, response) pairs go to every replica's draft history and to the run
        directory's log (for a replica that restarts)."""
        hist = self.tlt.speculation.history_config()
        if hist is None or not (self.tlt.speculation.suffix and self.tlt.speculation.enable):
            return
        pairs = list(zip(prompts, responses))
        self._add_history(step, pairs)
        self._records.log_history(step, pairs, hist)

    def _add_history(self, step: int, pairs: list) -> None:
        ray.get([s.add_history.remote(step, pairs) for s in self._servers()], timeout=120)

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
        self._coordinator.close()


def _sglang_replica():
    from verl.workers.rollout import replica as verl_replica

    verl_replica._load_sglang()  # verl's own loader first: what importing its SGLang server needs
    from tlt.integrations.verl.sglang_server import TLTSGLangReplica

    return TLTSGLangReplica


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


def _feature_layers(tlt: TLTConfig, model_path: str) -> list[int]:
    """The target layers the drafter reads besides the last hidden state (EAGLE-3's aux layers,
    none for EAGLE): the warm-up drafter's, else the method's defaults for this target."""
    from tlt.drafter.eagle import DrafterConfig, read_config
    from tlt.drafter.model_config import ModelConfig

    if tlt.drafter.init_path:
        return list(read_config(tlt.drafter.init_path).aux_layers)
    return list(DrafterConfig.for_target(ModelConfig.from_pretrained(model_path), tlt.drafter.method).aux_layers)
