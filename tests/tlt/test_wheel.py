"""The package as users install it: every product folder is listed in pyproject's ``packages`` (the
listed form is needed: setuptools' ``find`` cannot apply the ``package-dir`` renames), and a wheel
built from the checkout, installed into a fresh venv that sees this venv's dependencies but not the
checkout, runs the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _import_name(folder: Path, dirs: dict[str, str]) -> str:
    """The import name a checkout folder installs as, by pyproject's ``package-dir``."""
    rel = folder.relative_to(ROOT).as_posix()
    for name, src in sorted(dirs.items(), key=lambda kv: -len(kv[1])):
        if rel == src or rel.startswith(src + "/"):
            return name + rel[len(src):].replace("/", ".")
    return rel.replace("/", ".")


def product_packages() -> set[str]:
    """Import names of every folder of the product: Python packages and the YAML config folders."""
    dirs = _pyproject()["package-dir"]
    roots = [ROOT / "tlt", *(ROOT / d for d in dirs.values())]
    found = set()
    for root in roots:
        for f in [*root.rglob("__init__.py"), *root.rglob("*.yaml")]:
            if "__pycache__" not in f.parts:
                found.add(_import_name(f.parent, dirs))
    return found


def test_every_product_folder_is_listed():
    missing = product_packages() - set(_pyproject()["packages"])
    assert not missing, f"pyproject.toml's [tool.setuptools] packages lacks {sorted(missing)}: a wheel would not ship them"


def test_the_listing_check_sees_subpackages():
    assert {"tlt.sim", "tlt.integrations.verl", "tlt.rollout", "tlt.configs.tlt"} <= product_packages()


@pytest.mark.slow
def test_the_wheel_installs_and_runs(tmp_path):
    """Build with --no-build-isolation (nothing downloaded), install --no-deps into a new venv whose
    path reaches this venv's site-packages after its own, outside the checkout."""
    wheels, src = tmp_path / "wheels", tmp_path / "src"  # a copy: setuptools builds in the source tree
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".sglang-envs", "runs", ".tlt_cache", "build",
                                                               "*.egg-info", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(src)], check=True, cwd=tmp_path)
    (whl,) = wheels.glob("tlt_rollout-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for pkg in product_packages():
        assert any(n.startswith(pkg.replace(".", "/") + "/") for n in names), f"the wheel lacks {pkg}"
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(whl)],
                   check=True)
    # this venv's dependencies (not its .pth files: the checkout's editable finder stays out)
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{env_dir / 'bin'}:{env['PATH']}"

    def run(*args: str) -> str:
        res = subprocess.run([str(py), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{args}: {res.stderr[-2000:]}"
        return res.stdout

    where = run("-c", "import tlt, tlt.sim, tlt.rollout; print(tlt.__file__)").strip()
    assert Path(where).is_relative_to(site), f"tlt imported from {where}, not the installed wheel"
    cli = ("-m", "tlt")
    run(*cli, "--help")
    subcommands = ["make-target", "warmup", "export", "rollout", "report", "coordinator", "bench", "doctor", "demo"]
    for sub in subcommands:
        run(*cli, sub, "--help")
    run(*cli, "-q", "bench", "cluster", "--quick", "--json", str(tmp_path / "cluster.json"))
    assert (tmp_path / "cluster.json").is_file()
    target, data, out = tmp_path / "target", tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    run(*cli, "-q", "make-target", "--out", str(target), "--cache", str(tmp_path / "cache"))
    data.write_text('{"prompt": "12+7="}\n{"prompt": "3*4="}\n')
    run(*cli, "-q", "rollout", "--target", str(target), "--data", str(data), "--n", "2", "--max-new-tokens", "8",
        "--out", str(out))
    assert len(out.read_text().splitlines()) == 4
