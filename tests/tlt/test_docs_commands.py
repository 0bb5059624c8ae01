"""Every shell block in the user documents is valid bash, and every ``tlt ...`` command in them parses
with the CLI's own argument parser (a figure pasted over a shell variable's name, or a renamed flag,
fails here before a user copies it)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tlt.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^```(bash|sh|shell|console)?[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks tagged bash/sh/shell."""
    return [m.group(2) for m in FENCE.finditer(text) if m.group(1) in ("bash", "sh", "shell")]


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


def test_the_checks_catch_a_corrupted_quickstart():
    """Today's two corruptions: a figure where a variable's name was, and an unknown flag."""
    corrupted = 'X=1\n2.41x (2.41-2.41)=$(python -c "print(1)")\necho "$X"\n'
    assert _bash_errors(corrupted) != ""
    assert tlt_commands("A=1 tlt bench step-cost --shape demo && tlt demo --quick  # c\n") == [
        ["bench", "step-cost", "--shape", "demo"], ["demo", "--quick"]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "step-cost", "--no-such-flag"])
