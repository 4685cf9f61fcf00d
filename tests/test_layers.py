"""Imports run one way: compress, then the core of lit_fsdp, then offload and callbacks, then the application.

Every import in every module counts, wherever it is written: at module level, inside a function, under
``if TYPE_CHECKING:``, or as ``import_module("...")`` with a literal name. A lazy import still makes a cycle;
it only hides it until run time.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("compress", "lit_fsdp", "offload", "callbacks")

COMPRESS, CORE, FEATURES, APPLICATION = 0, 1, 2, 3
LAYER_NAMES = {COMPRESS: "compress", CORE: "lit_fsdp core", FEATURES: "offload/callbacks", APPLICATION: "application"}
#: The modules of lit_fsdp that are commands or wire every package together; the rest of lit_fsdp is the core.
APPLICATION_MODULES = (
    "lit_fsdp.cli",
    "lit_fsdp.__main__",
    "lit_fsdp.tune",
    "lit_fsdp.estimate",  # what a run needs and how fast it can go, from every strategy's accounting
    "lit_fsdp.generate",
    "lit_fsdp.evaluate",
    "lit_fsdp.export",
    "lit_fsdp.trained",  # the model generate and evaluate load
    "lit_fsdp.launch",  # runs `python -m lit_fsdp fit` in a subprocess, for tune and the scripts
    "lit_fsdp.sweep",  # runs of methods x strategies x seeds, for the scripts
    "lit_fsdp.compare_runs",  # tables and plots of runs' results, for the scripts
)
#: offload and callbacks share a layer and do not import each other.
SIBLINGS = {"offload", "callbacks"}


def layer(module: str) -> int | None:
    """The layer of a module of this repository, None for anything else (torch, lightning, the standard library)."""
    top = module.split(".")[0]
    if top == "compress":
        return COMPRESS
    if top in SIBLINGS:
        return FEATURES
    if top == "lit_fsdp":
        if any(module == app or module.startswith(app + ".") for app in APPLICATION_MODULES):
            return APPLICATION
        return CORE
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import in ``tree``, at any depth; ``from pkg import mod`` names the submodule."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in known else base))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def package_imports() -> list[tuple[Path, int, str, str]]:
    """(file, line, importing module, imported module) for every module of the four packages, once per line."""
    paths = sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))
    known = {module_name(p) for p in paths}
    found = []
    for path in paths:
        name = module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        pairs = dict.fromkeys(imported(tree, name, path.name == "__init__.py", known))
        found += [(path, line, name, target) for line, target in pairs]
    return found


def violations() -> list[str]:
    bad = []
    for path, line, name, target in package_imports():
        mine, theirs = layer(name), layer(target)
        if theirs is None:
            continue
        sibling = mine == theirs == FEATURES and name.split(".")[0] != target.split(".")[0]
        if theirs > mine or sibling:
            where = f"{path.relative_to(REPO)}:{line}"
            bad.append(f"{where}: {name} ({LAYER_NAMES[mine]}) imports {target} ({LAYER_NAMES[theirs]})")
    return bad


def test_every_package_module_has_a_layer():
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            assert layer(module_name(path)) is not None, path


def test_lower_layers_never_import_higher_ones():
    bad = violations()
    assert not bad, "imports that run up the layers (see README, Architecture):\n" + "\n".join(bad)


def test_compress_imports_only_torch_and_the_standard_library():
    outside = [
        f"{path.relative_to(REPO)}:{line}: {target}"
        for path, line, name, target in package_imports()
        if name.split(".")[0] == "compress"
        and target.split(".")[0] not in {"compress", "torch", *sys.stdlib_module_names}
    ]
    assert not outside, "compress/ is the bottom layer: torch only\n" + "\n".join(outside)


def test_a_lazy_upward_import_is_caught(tmp_path):
    """The check reads function bodies and TYPE_CHECKING blocks, not just the top of a module."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lit_fsdp.strategy import FSDP2Strategy\n"
        "def f():\n    from offload import strategy\n    import_module('lit_fsdp.cli')\n"
    )
    targets = [t for _, t in imported(ast.parse(source), "compress.x", False, {"offload.strategy"})]
    assert targets == ["typing", "lit_fsdp.strategy", "offload.strategy", "lit_fsdp.cli"]
