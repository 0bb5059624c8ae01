"""Imports point one way (docs/ARCHITECTURE.md): ``coordinator`` imports nothing of ours and no
torch, ``drafter`` nothing of rollout's, coordinator's or the integrations', ``rollout`` may import
``drafter`` but never ``coordinator`` or the integrations; no product module imports the benches,
the demo, the simulator or the tests, and the CLI imports them only inside the command that needs
them. Function-local imports count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder -> its import name (pyproject's package-dir)
PACKAGES = {"rollout": "tlt.rollout", "drafter": "tlt.drafter", "coordinator": "tlt.coordinator", "tlt": "tlt"}
NOT_PRODUCT = ("tlt.bench", "tlt.demo", "tlt.sim", "tests")
FORBIDDEN = {  # package -> what it must not import
    "tlt.coordinator": ("tlt", "torch"),
    "tlt.drafter": ("tlt.rollout", "tlt.coordinator", "tlt.integrations", *NOT_PRODUCT),
    "tlt.rollout": ("tlt.coordinator", "tlt.integrations", *NOT_PRODUCT),
    "tlt.integrations": NOT_PRODUCT,
}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            out[".".join((name, *rel)).removesuffix(".__init__")] = path
    return out


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, at the module's top level) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, id(node) in top))
    return out


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in sorted(modules.items()):
        for target, top_level in imports(path):
            if name == "tlt.cli":  # the CLI: a bench or the demo inside its command only
                if top_level and _under(target, NOT_PRODUCT):
                    bad.append(f"{name} imports {target} at its top level")
                continue
            rules = [pre for pkg, pre in FORBIDDEN.items() if _under(name, [pkg])]
            if not _under(name, NOT_PRODUCT) and not rules and name != "tlt.__main__":
                rules = [NOT_PRODUCT]  # tlt's own top-level modules
            if any(_under(target, pre) and not _under(target, [name.split(".")[0] + "." + name.split(".")[1]])
                   for pre in rules):
                bad.append(f"{name} imports {target}")
    return bad


def test_imports_point_one_way():
    assert violations(_modules()) == []


@pytest.mark.parametrize("module,source,found", [
    ("tlt.rollout.x", "from tlt.coordinator import Coordinator\n", "tlt.rollout.x imports tlt.coordinator"),
    ("tlt.coordinator.x", "def f():\n    import torch\n", "tlt.coordinator.x imports torch"),
    ("tlt.integrations.verl.x", "from tlt.bench.fixtures import demo_drafter\n",
     "tlt.integrations.verl.x imports tlt.bench.fixtures"),
    ("tlt.cli", "from tlt.demo.job import run_demo\n", "tlt.cli imports tlt.demo.job at its top level"),
])
def test_the_check_finds_a_wrong_import(tmp_path, module, source, found):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert violations({module: path}) == [found]


def test_the_cli_may_import_the_demo_inside_a_command(tmp_path):
    path = tmp_path / "cli.py"
    path.write_text("def _cmd_demo(args):\n    from tlt.demo.job import run_demo\n")
    assert violations({"tlt.cli": path}) == []
