"""treespec installed as users install it (issue 49): the wheel and the sdist built from the
checkout's files, the wheel installed into a fresh virtual environment, and the installed package
run from a folder outside the checkout: every subpackage imported from site-packages, the CLI,
the C kernels built from the installed sources into the user's cache, and one real bf16
``generate`` with the shipped EAGLE head against plain decoding.

Slow: the fresh environment installs torch and transformers (about a minute), and the generate
uses the real default model (pulled into $TREESPEC_HOME once)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# checkout folder -> its place in the wheel
FOLDERS = {"treespec": "treespec", "kernels": "treespec/kernels", "heads": "treespec/heads"}
BUILD = "from setuptools import build_meta; import sys; print(getattr(build_meta, sys.argv[1])(sys.argv[2]))"


def _checkout_files() -> list[str]:
    """The checkout's files as git sees them: tracked, and untracked ones it does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def _build(source: Path, kind: str, out: Path) -> Path:
    """``build_sdist`` or ``build_wheel`` through setuptools' PEP 517 backend, as pip runs it."""
    done = subprocess.run([sys.executable, "-c", BUILD, kind, str(out)], cwd=source,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, f"{kind} failed:\n{done.stderr[-3000:]}"
    return out / done.stdout.strip().splitlines()[-1]


def _installed_names(files: list[str]) -> set[str]:
    """Where each package file of the checkout lands in the wheel."""
    names = set()
    for name in files:
        top, _, rest = name.partition("/")
        packaged = name.endswith(".py") or top != "treespec"  # kernels/ and heads/: their data too
        if top in FOLDERS and rest and "__pycache__" not in name and packaged:
            names.add(f"{FOLDERS[top]}/{rest}")
    return names


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("install")
    source = work / "source"
    for name in _checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    sdist = _build(source, "build_sdist", work / "dist")
    wheel = _build(source, "build_wheel", work / "dist")
    with tarfile.open(sdist) as archive:
        archive.extractall(work / "unpacked", filter="data")
    (unpacked,) = (work / "unpacked").iterdir()
    from_sdist = _build(unpacked, "build_wheel", work / "from-sdist")
    return {"work": work, "wheel": wheel, "sdist": sdist, "from_sdist": from_sdist}


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {n for n in archive.namelist() if ".dist-info/" not in n}


def test_the_wheel_holds_every_module_and_data_file_and_the_sdist_builds_the_same_wheel(built):
    names = _wheel_names(built["wheel"])
    expected = _installed_names(_checkout_files())
    # heads/corpus is training input read from a path the user names, not package data
    expected = {n for n in expected if not n.startswith("treespec/heads/corpus/")}
    assert sorted(expected - names) == []
    for needed in ("treespec/target/runner.py", "treespec/tree/token_tree.py", "treespec/kernels/cpu_kernels.c",
                   "treespec/heads/shipped/smollm2-135m-instruct-eagle/model.safetensors"):  # fmt: skip
        assert needed in names  # treespec/target/: a name the common .gitignore templates ignore
    assert _wheel_names(built["from_sdist"]) == names  # the sdist carries everything the wheel does


@pytest.fixture(scope="module")
def venv(built) -> Path:
    """A fresh virtual environment with the wheel installed as a user would (torch first, pinned)."""
    env = built["work"] / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q"]
    for args in (["torch==2.13.0"], [str(built["wheel"])]):
        done = subprocess.run(pip + args, capture_output=True, text=True)
        assert done.returncode == 0, f"pip install {args} failed:\n{done.stderr[-3000:]}"
    return env


def _run_outside(venv: Path, work: Path, args: list[str], env: dict[str, str] | None = None):
    outside = work / "elsewhere"
    outside.mkdir(exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=outside, env={**clean, **(env or {})}, capture_output=True, text=True)


def test_the_installed_cli_answers_help_and_version(built, venv):
    from importlib import metadata

    for flag in ("--help", "--version"):
        done = _run_outside(venv, built["work"], [str(venv / "bin" / "treespec"), flag])
        assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"treespec {metadata.version('treespec')}"


INSTALLED_RUN = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys, sysconfig
    from pathlib import Path

    import torch

    import treespec
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    packages = ["treespec"] + [m.name for m in pkgutil.walk_packages(treespec.__path__, "treespec.") if m.ispkg]
    places = {name: str(Path(importlib.import_module(name).__file__).resolve()) for name in packages}
    outside = {name: place for name, place in places.items() if not place.startswith(str(site))}

    from treespec import heads
    from treespec.kernels import cpu_kernels
    from treespec.models import load
    from treespec.presets import EAGLE_TREE
    from treespec.proposers.eagle import EagleProposer

    model, tokenizer = load(sys.argv[1], dtype=torch.bfloat16)
    chat = [{"role": "user", "content": "Write three facts about the Moon."}]
    prompt = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    plain = treespec.generate(model, [prompt], max_new_tokens=32, proposer=None)
    head = heads.load(heads.shipped_for("smollm2-135m-instruct")["eagle"], dtype=torch.bfloat16)
    eagle = treespec.generate(model, [prompt], max_new_tokens=32, proposer=EagleProposer(head, model, **EAGLE_TREE))
    print(json.dumps({
        "packages": packages, "outside": outside, "version": treespec.__version__,
        "shipped": sorted(heads.shipped_for("smollm2-135m-instruct")),
        "kernels": cpu_kernels.available(), "kernels_reason": cpu_kernels.unavailable_reason(),
        "plain": plain.sequences[0], "eagle": eagle.sequences[0], "tau": eagle.stats.tau,
    }))
    """
)


def test_the_installed_package_imports_from_site_packages_and_speculates_exactly(built, venv):
    import json

    from treespec import models

    folder = models.pull("smollm2-135m-instruct")
    home = built["work"] / "home"  # an empty cache: the kernels build from the installed sources
    done = _run_outside(venv, built["work"], [str(venv / "bin" / "python"), "-c", INSTALLED_RUN, str(folder)],
                        env={"TREESPEC_HOME": str(home)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"treespec.target", "treespec.tree", "treespec.kernels", "treespec.heads", "treespec.heads.training",
            "treespec.engine", "treespec.proposers", "treespec.bench"} <= set(result["packages"])  # fmt: skip
    assert result["outside"] == {}, "imported from outside site-packages"
    assert result["shipped"] == ["draft", "eagle", "medusa"]
    assert result["eagle"] == result["plain"] and result["tau"] > 1.0
    if result["kernels"]:  # an x86-64 CPU with AVX2 and a C compiler: built into the user's cache
        built_into = list((home / "kernels").glob("treespec_cpu_kernels_*.so"))
        assert len(built_into) == 1
        assert f"into {built_into[0]}" in done.stderr
    else:
        assert result["kernels_reason"]
