"""Text <-> token ids for a model directory, and the tokenizer the project trains itself.

Owns loading ``tokenizer.json`` (+ ``tokenizer_config.json`` chat template) with the
``tokenizers`` library only, rendering chat messages, and training the byte-level BPE tokenizer
of the embedded default target from the project's own corpus (no downloads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import jinja2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Jinja chat template in the HF convention (messages, add_generation_prompt).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TextTokenizer:
    """The few operations TLT needs: encode, decode, chat prompt, special ids."""

    def __init__(self, tok: Tokenizer, config: dict) -> None:
        self.tok = tok
        self.chat_template = config.get("chat_template")
        self.eos_token = _token_str(config.get("eos_token"))
        self.eos_id = tok.token_to_id(self.eos_token) if self.eos_token else None
        pad = _token_str(config.get("pad_token"))
        self.pad_id = tok.token_to_id(pad) if pad else None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "TextTokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{path}: no tokenizer.json (a fast tokenizer file is required)")
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        return cls(Tokenizer.from_file(str(file)), config)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template, ready to generate."""
        template = self.chat_template or CHAT_TEMPLATE
        text = jinja2.Environment().from_string(template).render(
            messages=messages, add_generation_prompt=True, bos_token="", eos_token=self.eos_token or "")
        return self.encode(text)


def _token_str(tok: str | dict | None) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: Path) -> TextTokenizer:
    """Byte-level BPE with single-digit numbers (arithmetic stays learnable), saved in HF format."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: config[k] for k in ("bos_token", "eos_token", "pad_token")}, indent=2))
    return TextTokenizer(tok, config)
