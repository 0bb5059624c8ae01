"""Prompt files: JSON, JSONL or parquet, with plain-text or chat-message prompts.

Owns reading a user's prompt file into :class:`PromptRecord` s and the error messages for files
that are missing, unreadable or in a schema we do not understand. Accepted rows:

- a string: the prompt text, used verbatim (already chat-formatted text stays as is);
- an object with ``prompt`` (string, or a list of ``{"role", "content"}`` messages as in verl's
  parquet files) or ``messages`` (a chat; a trailing assistant message becomes the response), and
  optionally ``response`` (a string).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUFFIXES = (".json", ".jsonl", ".parquet")


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    text: str | None = None  # verbatim prompt text
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) chat to template
    response: str | None = None

    def chat(self) -> list[dict[str, str]]:
        assert self.messages is not None
        return [{"role": r, "content": c} for r, c in self.messages]


def load_prompts(path: str | Path) -> list[PromptRecord]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {path} {'is a directory' if path.is_dir() else 'does not exist'}")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"data file {path}: unknown extension {path.suffix!r}; use one of {SUFFIXES}")
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"data file {path} holds no prompts")
    return [_record(row, path, i) for i, row in enumerate(rows)]


def _read_rows(path: Path) -> list[Any]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("reading parquet needs pyarrow: pip install pyarrow") from None
        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for corrupt files
            raise ValueError(f"data file {path} is not readable parquet: {err}") from None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"data file {path} is not UTF-8 text (byte {err.start}): save it as UTF-8") from None
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from None
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if isinstance(data, dict):
        for key in ("prompts", "data", "rows"):
            if isinstance(data.get(key), list):
                return data[key]
        raise ValueError(f"{path}: expected a list of prompts (or an object with a 'prompts' list)")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of prompts, got {type(data).__name__}")
    return data


def _messages(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: each message needs string 'role' and 'content', got {m!r:.80}")
        out.append((m["role"], m["content"]))
    return tuple(out)


def _record(row: Any, path: Path, i: int) -> PromptRecord:
    where = f"{path} row {i}"
    if isinstance(row, str):
        if not row.strip():
            raise ValueError(f"{where}: empty prompt")
        return PromptRecord(text=row)
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a string or an object, got {type(row).__name__}")
    response = row.get("response")
    if response is not None and not isinstance(response, str):
        raise ValueError(f"{where}: 'response' must be a string")
    if "messages" in row:
        msgs = _messages(row["messages"], where)
        if msgs[-1][0] == "assistant" and response is None:
            msgs, response = msgs[:-1], msgs[-1][1]
        if not msgs:
            raise ValueError(f"{where}: no prompt messages before the assistant reply")
        return PromptRecord(messages=msgs, response=response)
    prompt = row.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        return PromptRecord(text=prompt, response=response)
    if isinstance(prompt, list):
        return PromptRecord(messages=_messages(prompt, where), response=response)
    raise ValueError(f"{where}: no usable 'prompt' or 'messages' field (keys: {sorted(row)[:8]})")
