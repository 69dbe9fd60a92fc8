"""The installable package: pyproject's dependencies agree with requirements.txt, and a wheel built from the
source holds every module (namespace packages, the configs as ``lconv.configs``, ``lconv.bench``, the entry
points) and the bundled corpus, and declares the dependencies. (.ci/run installs that wheel into a fresh virtualenv
and runs it from outside the checkout.)"""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEST_TOOLS = {"pytest", "pytest-xdist", "ruff", "nbclient", "nbformat", "ipykernel"}
OPTIONAL = {"fairseq": {"torch"}}  # extra -> packages requirements.txt pins (exactly: CI's build) and CI installs


def _requirement(line: str) -> tuple[str, str]:
    """``"etils[epath]>=1.7  # why"`` -> ``("etils", ">=1.7")``; names normalised as pip does."""
    spec = line.split("#")[0].strip()
    name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0)
    bounds = re.sub(r"\[[^\]]*\]", "", spec)[len(name):].replace(" ", "")
    return re.sub(r"[-_.]+", "-", name).lower(), ",".join(sorted(bounds.split(",")))


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_declares_requirements_txt_with_the_same_bounds():
    pinned = dict(_requirement(line) for line in (ROOT / "requirements.txt").read_text().splitlines()
                  if line.split("#")[0].strip())
    project = _pyproject()["project"]
    declared = dict(_requirement(r) for r in project["dependencies"])
    extras = {name: extra for extra, names in OPTIONAL.items() for name in names}
    runtime = {name: bounds for name, bounds in pinned.items() if name not in TEST_TOOLS | set(extras)}
    assert declared == runtime  # the same names and bounds: CI tests what `pip install .` installs
    for name, extra in extras.items():  # CI installs the optional extras' packages too, for their tests
        assert name in pinned and name in {_requirement(r)[0] for r in project["optional-dependencies"][extra]}
    assert {_requirement(r)[0] for r in project["optional-dependencies"]["test"]} == TEST_TOOLS
    assert "flatbuffers" in declared  # jax.export's serialize() (lconv.export)


@pytest.mark.slow  # builds a wheel with pip: the slow tier
def test_a_wheel_holds_every_module_the_configs_and_the_corpus(tmp_path):
    source = tmp_path / "src"  # a copy, so the build's build/ folder does not land in the checkout
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("lconv", "configs"):
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "docs" / "results", source / "docs" / "results")  # lconv/study/results links there
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                    str(source)], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("lconv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "lconv").rglob("*.py") if "__pycache__" not in p.parts}
    configs = {f"lconv/configs/{p.name}" for p in (ROOT / "configs").glob("*.py")}
    snapshot = {f"lconv/data/snapshot/{p.name}" for p in (ROOT / "lconv" / "data" / "snapshot").iterdir()}
    assert modules | configs | snapshot <= names, sorted((modules | configs | snapshot) - names)
    assert {"lconv/nn/models.py", "lconv/bench/__main__.py", "lconv/train/__main__.py", "lconv/configs/default.py",
            "lconv/export/__init__.py", "lconv/export/__main__.py", "lconv/run/schema.py", "lconv/api.py",
            "lconv/study/results/results.json"} <= names
    shipped = zipfile.ZipFile(wheel).read("lconv/study/results/results.json")
    assert shipped == (ROOT / "docs" / "results" / "results.json").read_bytes()  # the study's table, one copy
    assert not any(n.startswith(("configs/", "tests/")) for n in names)  # nothing outside the lconv package
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    required = {_requirement(line.split(":", 1)[1].split(";")[0])[0] for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert required == {_requirement(r)[0] for r in _pyproject()["project"]["dependencies"]}


def test_the_study_results_the_package_reads_are_the_committed_ones():
    """Notebook 03 reads the study's table through ``lconv.study.results_file`` (shipped in the package, issue 28:
    an installed lconv found none); in a clone it is docs/results', not a copy that could drift."""
    from lconv import study

    assert study.results_file().resolve() == (ROOT / "docs" / "results" / "results.json").resolve()
    assert study.results_file("results.csv").read_bytes() == (ROOT / "docs" / "results" / "results.csv").read_bytes()


def test_the_top_level_names_the_readme_uses_are_attributes_of_lconv():
    """``import lconv`` then ``lconv.export.load`` / ``lconv.testing.check_mixer`` / ``lconv.register_mixer``: the
    README writes them so (``lconv.export`` was an AttributeError); the lazy attributes import on first use."""
    import lconv

    assert callable(lconv.export.load) and callable(lconv.testing.check_mixer)
    assert callable(lconv.register_mixer) and callable(lconv.register_ffn) and callable(lconv.load)
    with pytest.raises(AttributeError, match="no_such_name"):
        lconv.no_such_name  # noqa: B018
