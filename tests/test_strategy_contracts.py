"""The strategy's contracts are declared, not probed: what FSDP2Strategy asks of its comm hook (``GradientCommHook``)
and what callbacks read from a strategy (``lit_fsdp.reporting.StrategyReport``)."""

from __future__ import annotations

import ast
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from callbacks.run_folder import compression_method
from callbacks.throughput import compute_dtype
from compress.config import CompressionConfig
from compress.hook import GradientCompression
from lit_fsdp.ddp import DDPStrategy
from lit_fsdp.reporting import LightningStrategyReport, OffloadReport, StrategyReport, strategy_report
from lit_fsdp.strategy import CommHook, FSDP2Strategy, GradientCommHook
from offload import SlideFSDPStrategy
from tests.probes import CountReduceScatters

REPO = Path(__file__).resolve().parents[1]


def probes_of(path: Path, names: set[str]) -> list[str]:
    """``getattr``/``hasattr`` calls in ``path`` whose object mentions one of ``names`` (``trainer.strategy``, ...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") and node.args:
            target = ast.unparse(node.args[0])
            if any(name in target for name in names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_strategy_reads_its_comm_hook_only_through_the_declared_protocol():
    members = {name for name in vars(GradientCommHook) if not name.startswith("_")} | set(
        typing.get_type_hints(GradientCommHook, localns={"CommStats": object, "FSDPModule": object, "DeviceMesh": object}))
    assert {"register", "optimizer", "state_dict", "load_state_dict", "replaces_replicate_all_reduce", "stats"} <= members
    assert not probes_of(REPO / "lit_fsdp" / "strategy.py", {"comm_hook"})
    used = {node.attr for node in ast.walk(ast.parse((REPO / "lit_fsdp" / "strategy.py").read_text()))
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self.comm_hook"}
    assert used and used <= members, used - members


def test_compression_and_a_hook_that_only_registers_both_satisfy_the_hook_protocol():
    assert isinstance(GradientCompression(CompressionConfig(method="int8")), GradientCommHook)
    counting = CountReduceScatters("/dev/null")
    assert isinstance(counting, GradientCommHook)
    assert counting.optimizer([]) is None and counting.state_dict() == {} and counting.stats is None
    with pytest.raises(ValueError, match="keeps no state, but the checkpoint holds"):
        counting.load_state_dict({"residual": torch.zeros(1)})
    with pytest.raises(NotImplementedError, match="must say how it installs itself"):
        CommHook().register(None, None)


def test_callbacks_never_probe_a_strategy_and_read_the_declared_report():
    probed = [line for path in sorted((REPO / "callbacks").glob("*.py")) for line in probes_of(path, {"strategy"})]
    assert not probed, "callbacks read lit_fsdp.reporting.StrategyReport, not the strategy's attributes:\n" + "\n".join(probed)


@pytest.mark.parametrize("strategy", [FSDP2Strategy(), SlideFSDPStrategy(), DDPStrategy()], ids=type)
def test_every_lit_fsdp_strategy_declares_the_report_the_callbacks_read(strategy):
    assert isinstance(strategy, StrategyReport)
    trainer = SimpleNamespace(strategy=strategy, precision="32-true")
    assert strategy_report(trainer) is strategy and strategy.label
    strategy.parallel_devices = [torch.device("cpu")]
    assert compute_dtype(trainer) == torch.float32 and isinstance(strategy.activation_checkpointing, int)
    assert strategy.offload_report() is None  # SlideFSDP: until its engine is built


def test_slide_fsdp_gives_everything_the_offload_report_declares():
    strategy = SlideFSDPStrategy()
    declared = {name for name in vars(OffloadReport) if not name.startswith("_")} | set(OffloadReport.__annotations__)
    assert {"last_step", "update_threads_reason", "host_state_bytes", "parameter_count", "host_buffer_estimate"} <= declared
    assert all(hasattr(strategy, name) for name in declared), [n for n in declared if not hasattr(strategy, n)]


def test_compression_is_reported_by_the_strategy_that_has_it():
    compressing = FSDP2Strategy(compression=CompressionConfig(method="int8"))
    assert compression_method(SimpleNamespace(strategy=compressing)) == "int8"
    assert isinstance(compressing.compression_hook(), GradientCompression)
    assert FSDP2Strategy(comm_hook=CountReduceScatters("/dev/null")).compression_hook() is None
    assert compression_method(SimpleNamespace(strategy=SlideFSDPStrategy())) == "none"


def test_a_strategy_that_is_not_lit_fsdps_is_reported_from_the_trainer():
    trainer = SimpleNamespace(strategy=SingleDeviceStrategy(device=torch.device("cpu")), precision="bf16-mixed")
    report = strategy_report(trainer)
    assert isinstance(report, LightningStrategyReport) and report.label == "SingleDeviceStrategy"
    assert report.compute_dtype() == torch.bfloat16 and report.compression is None
    assert report.compression_hook() is None and report.offload_report() is None and report.activation_checkpointing == 0
