"""Every shell block in the user documents is valid bash, and every ``tlt ...`` command in them parses
with the CLI's own argument parser (a figure pasted over a shell variable's name, or a renamed flag,
fails here before a user copies it).

Every shell block is tagged, in an HTML comment on the line before its fence (after it, for a block
that opens its file): ``<!-- runs -->`` or ``<!-- illustrative: <why it cannot run here> -->``. The
"runs" blocks run here, at quick sizes (:data:`QUICK`), in a temporary directory, within
:data:`RUNS_BUDGET_S` together."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tlt.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^```(bash|sh|shell|console)?[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


TAG = re.compile(r"<!-- (runs|illustrative: \S.*?) -->")
# What a "runs" block runs with here instead of the user's sizes (the docs keep the user's).
QUICK = {"--train-steps 300": "--train-steps 20", "--max-steps 100": "--max-steps 4",
         "trainer.total_training_steps=4": "trainer.total_training_steps=1"}
RUNS_BUDGET_S = 300  # every "runs" block together, on CI's 2 cores (about 110 s measured)


def shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks tagged bash/sh/shell."""
    return [body for _, body in tagged_blocks(text)]


def tagged_blocks(text: str) -> list[tuple[str | None, str]]:
    """(tag, body) of every bash/sh/shell block: ``runs``, ``illustrative: ...`` or None."""
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) not in ("bash", "sh", "shell"):
            continue
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        after = text[m.end():].lstrip("\n").split("\n", 1)[0] if m.start() == 0 else ""
        tag = TAG.fullmatch(before.strip()) or TAG.fullmatch(after.strip())
        out.append((tag.group(1) if tag else None, m.group(2)))
    return out


def quick(block: str) -> str:
    """A "runs" block as this test runs it: :data:`QUICK`'s sizes, and its ``pip install`` lines left
    out (this environment is what they install)."""
    for user, small in QUICK.items():
        block = block.replace(user, small)
    return "\n".join(":  # installed" if line.startswith("pip install") else line for line in block.splitlines())


def tlt_commands(block: str) -> list[list[str]]:
    """The argument lists of every ``tlt`` invocation in a block (continuation lines joined,
    comments dropped, commands split at ``&&``, ``;`` and ``|``)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # unbalanced quotes: bash -n reports the block
            continue
        cmd: list[str] = []
        for w in words + ["&&"]:
            if w in ("&&", ";", "|", "||"):
                if cmd and cmd[0] == "tlt":
                    out.append(cmd[1:])
                cmd = []
            elif not (not cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w)):  # leading VAR=value
                cmd.append(w)
    return out


def _bash_errors(block: str) -> str:
    res = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
    return res.stderr.strip()


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash -n needs bash")
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_blocks_are_valid_bash(doc):
    for block in shell_blocks(doc.read_text()):
        assert _bash_errors(block) == "", f"{doc.name}: a shell block bash cannot parse:\n{block}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_tlt_commands_parse(doc):
    parser = build_parser()
    for block in shell_blocks(doc.read_text()):
        for argv in tlt_commands(block):
            try:
                parser.parse_args(argv)
            except SystemExit as e:
                raise AssertionError(f"{doc.name}: `tlt {shlex.join(argv)}` does not parse") from e


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shell_block_is_tagged(doc):
    for tag, block in tagged_blocks(doc.read_text()):
        assert tag is not None, (f"{doc.name}: tag this block <!-- runs --> or <!-- illustrative: reason --> "
                                 f"on the line before its fence:\n{block}")


def test_tags_are_read_and_an_untagged_block_is_found():
    text = ("```bash\necho top\n```\n<!-- illustrative: set-up -->\n\n<!-- runs -->\n```bash\ntlt demo\n```\n"
            "text\n```bash\necho untagged\n```\n<!-- illustrative: -->\n```sh\necho empty reason\n```\n")
    assert [t for t, _ in tagged_blocks(text)] == ["illustrative: set-up", "runs", None, None]
    assert quick("pip install -e .\ntlt make-target --train-steps 300") == (
        ":  # installed\ntlt make-target --train-steps 20")


def test_the_docs_run_some_blocks():
    """The "runs" blocks this test runs: README's own-prompts example and verl.md's quickstart."""
    runs = [(doc.name, b) for doc in DOCS for t, b in tagged_blocks(doc.read_text()) if t == "runs"]
    assert [n for n, _ in runs] == ["README.md", "verl.md"]
    for name, block in runs:  # every size QUICK shrinks is still in the block it shrinks
        assert quick(block) != block, name


@pytest.mark.slow
def test_the_runs_blocks_run(tmp_path):
    """Each "runs" block at quick sizes, in its own empty directory (a ``prompts.json`` of a user's
    texts beside it), with this environment's ``python`` and ``tlt`` first on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "TLT_CACHE": str(tmp_path / "cache")}
    start = time.monotonic()
    for i, (doc, block) in enumerate((d, b) for d in DOCS for t, b in tagged_blocks(d.read_text()) if t == "runs"):
        cwd = tmp_path / f"block{i}"
        cwd.mkdir()
        (cwd / "prompts.json").write_text(json.dumps([f"Compute {a} + {a + 3}." for a in range(8)]))
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", quick(block)], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=RUNS_BUDGET_S)
        assert p.returncode == 0, f"{doc.name}:\n{quick(block)}\n{p.stdout[-2000:]}{p.stderr[-4000:]}"
    assert time.monotonic() - start < RUNS_BUDGET_S


def test_the_checks_catch_a_corrupted_quickstart():
    """Today's two corruptions: a figure where a variable's name was, and an unknown flag."""
    corrupted = 'X=1\n2.41x (2.41-2.41)=$(python -c "print(1)")\necho "$X"\n'
    assert _bash_errors(corrupted) != ""
    assert tlt_commands("A=1 tlt bench step-cost --shape demo && tlt demo --quick  # c\n") == [
        ["bench", "step-cost", "--shape", "demo"], ["demo", "--quick"]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "step-cost", "--no-such-flag"])
