"""What a compression method needs is declared in its ``METHODS`` entry, not probed by the hook.

Each entry names its communicator (whose hooks build from exactly what ``GradientCompression.register`` passes),
``compress/hook.py`` tells methods apart by no compressor class, and each method that keeps state says what it is
and how to shrink it, naming options and methods that exist.
"""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from compress.communicator import CommStats, RestoredState
from compress.communicators import Communicator
from compress.config import METHODS, CompressionConfig
from compress.layout import unit_layout

COMPRESS = Path(__file__).resolve().parents[1] / "compress"
OPTION = "--compression"
ON_MESH = {"parameters": 10_000, "shard": 4, "replicas": 2, "rows": 64}  # HYBRID_SHARD: both hooks keep state


def _configured(name: str) -> CompressionConfig:
    """``name`` at its defaults, with error feedback where the method takes it (so it keeps state if it can)."""
    feedback = METHODS[name].feedback and not (name == "randomk" and METHODS[name].defaults["rescale"])
    return CompressionConfig(method=name, error_feedback=feedback)


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_declares_a_communicator_whose_hooks_build_from_what_register_passes(name):
    communicator = METHODS[name].communicator
    if name == "none":
        assert communicator is None  # FSDP2's own reduce-scatter: no hook
        return
    assert isinstance(communicator, Communicator)
    compressor = _configured(name).build(rank=0)
    layout = {"layout": unit_layout(torch.nn.Linear(8, 8), 2, 0)} if communicator.layout else {}
    stats, restored = CommStats(), RestoredState()
    reduce_scatter = communicator.reduce_scatter(compressor, stats, "unit0", restored=restored, **layout)
    second = communicator.second_stage(compressor) if communicator.second_stage is not None else compressor
    all_reduce = communicator.all_reduce(second, stats, "unit0", group=None, restored=restored, **layout)
    assert callable(reduce_scatter) and callable(all_reduce)
    if communicator.movers:  # their call counts go into checkpoints
        assert isinstance(reduce_scatter.mover.calls, int) and isinstance(all_reduce.mover.calls, int)
    if communicator.optimizer is not None:
        optimizer = communicator.optimizer([torch.nn.Parameter(torch.zeros(4))], compressor, lr=1e-3)
        assert isinstance(optimizer, torch.optim.Optimizer)


def test_only_the_methods_that_replace_adamw_declare_an_optimizer():
    replacing = {name for name, method in METHODS.items() if method.communicator and method.communicator.optimizer}
    assert replacing == {"onebit_adam", "zero_one_adam"}


def _compress_classes() -> set[str]:
    return {node.name for path in COMPRESS.glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)}


def _names(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _names(element)]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return [node.id] if isinstance(node, ast.Name) else []


def test_the_hook_tells_methods_apart_by_no_compressor_class():
    tree = ast.parse((COMPRESS / "hook.py").read_text())
    ours = _compress_classes()
    checked = [
        name for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass") and len(node.args) == 2
        for name in _names(node.args[1])
    ]
    assert not [name for name in checked if name in ours], "compress/hook.py asks isinstance of a compress class"
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not imported & {"PowerSGD", "SketchedSGD", "OneBitMomentum", "OneBitAdam"}
    probes = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "check_fits"]
    assert not probes  # the size check is declared by the method (``Method.fits``)


@pytest.mark.parametrize("name", [name for name in METHODS if _configured(name).state_bytes(**ON_MESH)])
def test_each_method_with_kept_state_says_what_it_is_and_how_to_shrink_it_with_options_that_exist(name):
    config = _configured(name)
    what, fix = config.state_advice(OPTION)
    assert what and fix
    options = re.findall(re.escape(OPTION) + r"\.(\w+)", fix)
    methods = re.findall(r"e\.g\. (\w+)", fix)
    assert options or methods, f"{name}: {fix!r} names neither an option nor a method"
    assert set(options) <= {f.name for f in fields(CompressionConfig)}
    for other in methods:  # the method suggested instead keeps nothing at its defaults
        assert other in METHODS and CompressionConfig(method=other).state_bytes(**ON_MESH) == 0
    if "residual_dtype" in options:  # the advice as given: bfloat16 residuals take less
        halved = CompressionConfig(method=name, error_feedback=config.error_feedback, residual_dtype="bfloat16")
        assert halved.state_bytes(**ON_MESH) < config.state_bytes(**ON_MESH)


def test_the_lowrank_size_check_is_declared_and_refuses_a_rank_above_the_chunks_matrix():
    assert CompressionConfig(method="int8").size_check() is None
    check = CompressionConfig(method="lowrank", rank=8).size_check()
    check(64 * 64)  # an 64 x 64 matrix takes rank 8
    with pytest.raises(ValueError, match="rank 8 is larger than the 3x3 matrix a 9-element gradient chunk makes"):
        check(9)


@pytest.mark.parametrize("method", ["onebit_adam", "zero_one_adam"])
def test_one_bit_adams_memory_advice_offers_only_what_shrinks_its_state(method):
    """Its error feedback is the method itself: turning error_feedback off is no advice (it is off already)."""
    what, fix = CompressionConfig(method=method).state_advice("--c")
    assert "error_feedback" not in fix and "residual_dtype bfloat16" in fix and "local momenta" in what
    smaller = CompressionConfig(method=method, residual_dtype="bfloat16")
    assert smaller.state_bytes(10**6, 2, 1, 64) * 2 == CompressionConfig(method=method).state_bytes(10**6, 2, 1, 64)
    assert "residual_dtype" not in smaller.state_advice("--c")[1]
