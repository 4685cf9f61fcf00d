"""Each folder is one layer, and imports run one way: compress/, then lit_fsdp/ (the core), then offload/ and
callbacks/, then lit_fsdp/commands/ (the application).

Every import in every module counts, wherever it is written: at module level, inside a function, under
``if TYPE_CHECKING:``, or as ``import_module("...")`` with a literal name. A lazy import still makes a cycle;
it only hides it until run time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("compress", "lit_fsdp", "offload", "callbacks")

COMPRESS, CORE, FEATURES, APPLICATION = 0, 1, 2, 3
LAYER_NAMES = {COMPRESS: "compress", CORE: "lit_fsdp core", FEATURES: "offload/callbacks", APPLICATION: "application"}
#: Each folder's layer; a folder not named here is its parent's.
FOLDER_LAYERS = {
    "compress": COMPRESS,
    "lit_fsdp": CORE,
    "offload": FEATURES,
    "callbacks": FEATURES,
    "lit_fsdp/commands": APPLICATION,
}
#: The one module outside its folder's layer: Python looks for ``python -m lit_fsdp``'s entry point in the package's
#: own folder, and it only calls lit_fsdp.commands.main.
ENTRY_POINT = "lit_fsdp.__main__"
#: offload and callbacks share a layer and do not import each other.
SIBLINGS = {"offload", "callbacks"}


def folder(module: str, is_package: bool = False) -> str:
    """The folder a module's file is in (a package's ``__init__`` is in its own folder)."""
    parts = module.split(".")
    return "/".join(parts if is_package else parts[:-1]) or parts[0]


def folder_layer(path: str) -> int | None:
    while path:
        if path in FOLDER_LAYERS:
            return FOLDER_LAYERS[path]
        path = path.rpartition("/")[0]
    return None


def layer(module: str) -> int | None:
    """The layer of a module of this repository, None for anything else (torch, lightning, the standard library)."""
    if module.split(".")[0] not in PACKAGES:
        return None
    if module == ENTRY_POINT:
        return APPLICATION
    is_package = (REPO / module.replace(".", "/") / "__init__.py").is_file()
    return folder_layer(folder(module, is_package))


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
    assert not bad, "imports that run up the layers (docs/architecture.md):\n" + "\n".join(bad)


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
        "def f():\n    from offload import strategy\n    import_module('lit_fsdp.commands.cli')\n"
    )
    targets = [t for _, t in imported(ast.parse(source), "compress.x", False, {"offload.strategy"})]
    assert targets == ["typing", "lit_fsdp.strategy", "offload.strategy", "lit_fsdp.commands.cli"]


def test_every_folder_has_a_declared_layer_and_no_folder_holds_two():
    """A module's layer is its folder's: the application is lit_fsdp/commands/, not modules listed by name."""
    folders = {str(p.parent.relative_to(REPO)) for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    assert all(folder_layer(f) is not None for f in folders), folders
    for path in (REPO / "lit_fsdp").glob("*.py"):
        name = module_name(path)
        assert name == ENTRY_POINT or layer(name) == CORE, name
    assert all(layer(module_name(p)) == APPLICATION for p in (REPO / "lit_fsdp" / "commands").rglob("*.py"))


def test_the_modules_of_a_folder_import_each_other_without_a_cycle():
    """A cycle, even through a type-only import, means two modules are one concern or a third is missing."""
    graph: dict[str, set[str]] = {}
    for _, _, name, target in package_imports():
        if target != name and layer(target) is not None:
            graph.setdefault(name, set()).add(target)
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in trail:
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif len(trail) < 12:
                visit(nxt, trail + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    # a package's __init__ re-exporting its modules is not a cycle of concerns
    real = [c for c in cycles if not any(m.count(".") == 0 or m.endswith("__init__") for m in c.split(" -> "))]
    assert not real, "import cycles:\n" + "\n".join(sorted(set(real)))


def test_importing_lit_fsdp_or_its_entry_point_loads_neither_torch_nor_lightning():
    code = ("import sys, lit_fsdp, lit_fsdp.commands, lit_fsdp.commands.main; "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"
