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


def imports(path: Path, name: str) -> list[tuple[str, bool]]:
    """(module imported, at the module's top level) for every import in ``path`` (module ``name``):
    ``from a import b`` counts as ``a.b`` (b may be a module), relative imports resolved."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            out += [(f"{base}.{a.name}", id(node) in top) for a in node.names]
    return out


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in sorted(modules.items()):
        own = ".".join(name.split(".")[:2]) if "." in name else None  # its package, or tlt's own module
        for target, top_level in imports(path, name):
            if name == "tlt.cli":  # the CLI: a bench or the demo inside its command only
                if top_level and _under(target, NOT_PRODUCT):
                    bad.append(f"{name} imports {target} at its top level")
                continue
            rules = [pre for pkg, pre in FORBIDDEN.items() if _under(name, [pkg])]
            if not _under(name, NOT_PRODUCT) and not rules and name != "tlt.__main__":
                rules = [NOT_PRODUCT]  # tlt's own top-level modules
            if any(_under(target, pre) and not (own and _under(target, [own])) for pre in rules):
                bad.append(f"{name} imports {target}")
    return bad


def test_imports_point_one_way():
    assert violations(_modules()) == []


@pytest.mark.parametrize("module,source,found", [
    ("tlt.rollout.x", "from tlt.coordinator import Coordinator\n", "tlt.rollout.x imports tlt.coordinator.Coordinator"),
    ("tlt.coordinator.x", "def f():\n    import torch\n", "tlt.coordinator.x imports torch"),
    ("tlt.coordinator.x", "from torch import nn\n", "tlt.coordinator.x imports torch.nn"),
    ("tlt.integrations.verl.x", "from tlt.bench.fixtures import demo_drafter\n",
     "tlt.integrations.verl.x imports tlt.bench.fixtures.demo_drafter"),
    ("tlt.cli", "from tlt.demo.job import run_demo\n", "tlt.cli imports tlt.demo.job.run_demo at its top level"),
    ("tlt.warmup", "from tlt import demo\n", "tlt.warmup imports tlt.demo"),
    ("tlt.rollout.x", "from ..integrations import verl\n", "tlt.rollout.x imports tlt.integrations.verl"),
    ("tlt", "from tlt.bench import fixtures\n", "tlt imports tlt.bench.fixtures"),
])
def test_the_check_finds_a_wrong_import(tmp_path, module, source, found):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert violations({module: path}) == [found]


def test_the_cli_may_import_the_demo_inside_a_command(tmp_path):
    path = tmp_path / "cli.py"
    path.write_text("def _cmd_demo(args):\n    from tlt.demo.job import run_demo\n")
    assert violations({"tlt.cli": path}) == []


def test_the_gpu_checks_modules_import_without_the_coordinators_dependencies():
    """The GPU check installs the project with ``--no-deps`` on a machine with torch and no package
    index, so pyzmq and msgpack are absent there: its benches and examples must import without them
    (the coordinator package exports lazily; its pure parts need neither)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['zmq'] = None; sys.modules['msgpack'] = None\n"
            "import tlt.bench.step_cost, tlt.bench.rollout, tlt.bench.attention, tlt.sim.workloads, tlt.cli\n"
            "import runpy; [runpy.run_path(p) for p in sys.argv[1:]]\n")
    examples = [str(ROOT / "examples" / f) for f in ("long_context_arms.py", "memory_window.py", "profile_step.py")]
    res = subprocess.run([sys.executable, "-c", code, *examples], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
