"""pyproject.toml's dependencies: every third-party module the installed packages import is declared, and every
dependency is capped below the minor release after the newest one tested, with the running one inside the range.
``NEWEST_TESTED`` records the releases .ci/run's newest-release run passed on, which each cap must admit."""

from __future__ import annotations

import ast
import os
import sys
import tomllib
from importlib.metadata import packages_distributions, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lit_fsdp", "compress", "callbacks", "offload")  # what pyproject.toml installs

#: The release of each capped dependency (the test extras' too) that .ci/run's newest-release run (.venv-newest, on
#: Python 3.12) installed when its list last passed: the newest the registry had, under caps that admit no later
#: minor release. Raise a cap and its entry together, after that run passes on the new release.
NEWEST_TESTED = {
    "torch": "2.14.1",
    "lightning": "2.6.6",
    "transformers": "5.24.0",
    "torchmetrics": "1.9.0",
    "wandb": "0.31.0",
    "jsonargparse": "4.53.0",
    "ijson": "3.6.0",
    "pyarrow": "26.0.1",
    "tokenizers": "0.23.3",
    "safetensors": "0.8.0",
    "matplotlib": "3.11.2",
    "numpy": "2.5.5",
    "pyyaml": "6.0.4",
    "tqdm": "4.70.1",
    "huggingface-hub": "2.4.0",
    "peft": "0.21.2",
}


def dependencies() -> list[Requirement]:
    return [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]


def capped_requirements() -> list[Requirement]:
    """The dependencies and the test extras that carry a cap."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    return dependencies() + [r for r in map(Requirement, extras) if any(s.operator == "<" for s in r.specifier)]


def test_every_third_party_module_the_packages_import_is_declared():
    declared = {canonicalize_name(r.name) for r in dependencies()}
    providers = packages_distributions()  # top-level module -> the distributions that install it
    missing: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top in sys.stdlib_module_names or top in PACKAGES or top == "__future__":
                        continue
                    if not {canonicalize_name(d) for d in providers.get(top, [top])} & declared:
                        missing.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not missing, "imported but not in pyproject.toml's dependencies: " + ", ".join(
        f"{module} ({where})" for module, where in sorted(missing.items()))


def test_every_dependency_is_capped_below_a_minor_release_and_the_running_one_is_inside():
    for requirement in dependencies():
        caps = [s for s in requirement.specifier if s.operator == "<"]
        assert len(caps) == 1 and len(Version(caps[0].version).release) == 2, (
            f"{requirement}: cap it below the minor release after the newest one tested, e.g. <X.Y")
        installed = version(requirement.name)
        assert requirement.specifier.contains(installed, prereleases=True), f"{requirement.name} {installed} is outside {requirement}"


def test_every_cap_admits_its_newest_tested_release_and_no_later_minor():
    capped = {canonicalize_name(r.name): r for r in capped_requirements()}
    assert set(capped) == set(NEWEST_TESTED), "NEWEST_TESTED and pyproject.toml's capped requirements differ"
    for name, requirement in capped.items():
        tested = Version(NEWEST_TESTED[name])
        cap = next(s for s in requirement.specifier if s.operator == "<")
        assert requirement.specifier.contains(tested), f"{requirement} refuses {name} {tested}, the newest release tested"
        assert cap.version == f"{tested.major}.{tested.minor + 1}", (
            f"{requirement}: the newest {name} tested is {tested}, so cap it at <{tested.major}.{tested.minor + 1}")


@pytest.mark.skipif(not os.environ.get("LIT_FSDP_NEWEST_RELEASES"),
                    reason="checks .ci/run's newest-release venv (LIT_FSDP_NEWEST_RELEASES=1)")
def test_the_newest_release_run_installed_the_releases_recorded_as_tested():
    installed = {name: version(name) for name in NEWEST_TESTED}
    differ = {name: f"{installed[name]} installed, {tested} recorded" for name, tested in NEWEST_TESTED.items()
              if Version(installed[name]).base_version != tested}
    assert not differ, ("the newest releases the caps admit are not the ones recorded as tested: " + "; ".join(
        f"{name} {what}" for name, what in sorted(differ.items())) + ": once this run passes, record them in "
        "tests/test_dependencies.py's NEWEST_TESTED")
