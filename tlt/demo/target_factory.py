"""The embedded default target: a small real-architecture model built and trained here.

Owns ``tlt make-target``: a Llama / Qwen2 / Qwen3 decoder sized for a laptop CPU, a byte-level
BPE tokenizer trained on the project's synthetic arithmetic corpus, optional training on that
corpus, and a content-keyed cache so tests and the demo build each model once.

Deep and narrow targets (the CPU's scale model of a GPU target: a decode step costs per layer
and hardly per token, a one-layer drafter 1/L of it) are trained by growing: ``trained_layers``
layers learn the corpus, then the model is deepened to ``num_layers`` by inserting layers whose
output projections are zero (each is the identity on the residual stream, so the function is
unchanged: Net2Net-style, function-preserving growth), and the whole depth trains ``grown_steps``
more steps at a thirtieth of the learning rate (higher undoes what the first phase learned). Training a deep model from scratch costs ``num_layers / trained_layers`` times more
per step on a CPU for what this corpus needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tlt.drafter.model_config import ModelConfig
from tlt.rollout.target import TargetModel
from tlt.demo.corpus import CorpusConfig, make_corpus
from tlt.tokenizer import TextTokenizer, train_tokenizer

log = logging.getLogger(__name__)
FACTORY_VERSION = 3  # bumped when the corpus or the training changes: cached targets rebuild
FAMILIES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetSpec:
    family: str = "llama"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 352
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    train_steps: int = 0
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 3e-3
    seed: int = 0
    trained_layers: int = 0  # > 0: train this many layers, then grow to num_layers (see the module doc)
    grown_steps: int = 0     # training steps at full depth after growing
    corpus: CorpusConfig = CorpusConfig()  # the training data's shape (its seed is replaced by ``seed``)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}; use one of {FAMILIES}")
        if self.train_steps < 0 or self.grown_steps < 0:
            raise ValueError(f"train_steps and grown_steps must be >= 0, got {self.train_steps}, {self.grown_steps}")
        if not 0 <= self.trained_layers <= self.num_layers:
            raise ValueError(f"trained_layers={self.trained_layers}: use 0 (train every layer) or 1..num_layers")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size must be >= 300 (256 bytes + specials), got {self.vocab_size}")

    def model_config(self, vocab_size: int | None = None, **token_ids: int | None) -> ModelConfig:
        """The architecture (``vocab_size``: the trained tokenizer's; ``token_ids``: bos/eos/pad)."""
        return ModelConfig(
            model_type=self.family, vocab_size=vocab_size or self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads, max_position_embeddings=self.max_position_embeddings,
            qkv_bias=self.family == "qwen2", qk_norm=self.family == "qwen3", **token_ids)

    def key(self) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "v": FACTORY_VERSION}, sort_keys=True)
        return f"{self.family}-s{self.train_steps}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def sample_tokens(tok: TextTokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids + eos) in the chat format the demo rolls out with."""
    p = tok.chat_prompt([{"role": "user", "content": prompt}])
    return p, tok.encode(response) + [tok.eos_id]


def build_target(spec: TargetSpec, out: Path, *, progress: bool = True) -> dict:
    """Write a HF-format model dir (config, safetensors, tokenizer) to ``out``; returns its meta."""
    torch.manual_seed(spec.seed)
    corpus = make_corpus(4000, dataclasses.replace(spec.corpus, seed=spec.seed))
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer((t for p in corpus for t in (p.prompt, p.response)),
                              spec.vocab_size, Path(tmp))
        vocab = tok.vocab_size
        cfg = spec.model_config(vocab, bos_token_id=tok.tok.token_to_id("<|bos|>"), eos_token_id=tok.eos_id,
                                pad_token_id=tok.pad_id)
        grow = 0 < spec.trained_layers < spec.num_layers
        model = TargetModel(dataclasses.replace(cfg, num_hidden_layers=spec.trained_layers) if grow else cfg)
        _init_weights(model)
        meta = {"family": spec.family, "spec": dataclasses.asdict(spec), "train_steps": 0}
        if spec.train_steps:
            meta.update(_train(model, tok, corpus, spec, spec.train_steps, spec.lr, progress))
        if grow:
            model = _grow(model, cfg)
            if spec.grown_steps:
                meta["grown"] = _train(model, tok, corpus, spec, spec.grown_steps, spec.lr / 30, progress)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(Path(tmp) / name, out / name)
    (out / "tlt_target.json").write_text(json.dumps(meta, indent=2))
    return meta


def _init_weights(model: TargetModel) -> None:
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)


def _grow(model: TargetModel, cfg: ModelConfig) -> TargetModel:
    """``model`` deepened to ``cfg.num_hidden_layers``: its layers spread evenly over the new depth,
    the new ones freshly initialised with zero output projections (identity layers)."""
    deep = TargetModel(cfg)
    _init_weights(deep)
    k, n = len(model.model.layers), cfg.num_hidden_layers
    where = {round(i * (n - 1) / max(1, k - 1)) if k > 1 else n - 1: i for i in range(k)}
    state = model.state_dict()
    with torch.no_grad():
        for name, p in deep.named_parameters():
            parts = name.split(".")
            if parts[:2] != ["model", "layers"]:
                p.copy_(state[name])
            elif int(parts[2]) in where:
                p.copy_(state[".".join(parts[:2] + [str(where[int(parts[2])])] + parts[3:])])
            elif name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight", "self_attn.o_proj.bias")):
                p.zero_()
    return deep


def _train(model: TargetModel, tok: TextTokenizer, corpus, spec: TargetSpec, steps: int, peak_lr: float,
           progress: bool) -> dict:
    stream: list[int] = []
    for prob in corpus:
        p, r = sample_tokens(tok, prob.prompt, prob.response)
        stream += p + r
    data = torch.tensor(stream)
    n_win = (len(data) - 1) // spec.seq_len
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(spec.seed + len(model.model.layers))
    warm = max(1, steps // 20)
    model.train()
    losses = []
    t0 = time.monotonic()
    desc = f"train target ({len(model.model.layers)} layers)"
    for step in tqdm(range(steps), desc=desc, disable=not progress):
        lr = peak_lr * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_win, (spec.batch_size,), generator=gen) * spec.seq_len
        idx = starts[:, None] + torch.arange(spec.seq_len + 1)
        batch = data[idx]
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    final = sum(losses[-20:]) / len(losses[-20:])
    log.info("target (%d layers) trained %d steps in %.0fs, final loss %.3f", len(model.model.layers), steps,
             time.monotonic() - t0, final)
    return {"train_steps": steps, "final_loss": final, "first_loss": losses[0],
            "train_seconds": time.monotonic() - t0}


def default_cache_dir() -> Path:
    return Path(os.environ.get("TLT_CACHE", Path.home() / ".cache" / "tlt"))


def ensure_target(spec: TargetSpec, cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """Path of the cached model for ``spec``, building it (atomically) on first use."""
    root = (cache_dir or default_cache_dir()) / "targets"
    final = root / spec.key()
    if (final / "tlt_target.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        build_target(spec, tmp, progress=progress)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
