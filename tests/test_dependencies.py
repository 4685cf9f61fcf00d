"""pyproject.toml's dependencies: every third-party module the installed packages import is declared, and every
dependency is capped below the minor release after the newest one tested, with the running one inside the range."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lit_fsdp", "compress", "callbacks", "offload")  # what pyproject.toml installs


def dependencies() -> list[Requirement]:
    return [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]


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
