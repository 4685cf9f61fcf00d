"""The compatibility modules of torch and Lightning: the range they state, what they provide, and that nothing else
reaches past them."""

from __future__ import annotations

import ast
import gc
import importlib
import os
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist

from compress import torch_compat
from tests.distributed import run

# lit_fsdp.lightning_compat is imported by the tests that use it: the spawned ranks import this module, and Lightning
# would double their start-up.

ROOT = Path(__file__).resolve().parents[1]
#: private or version-sensitive torch names: only compress/torch_compat.py may use them
PRIVATE = re.compile(r"_fsdp_api|algorithms\._checkpoint|kineto_results|all_gather_single|reduce_scatter_single|is_bf16_supported\(|"
                     r"torch\.distributed\.fsdp\._|_new_with_weak_ptr|StorageWeakRef")


#: private Lightning names (``from lightning.x import _y``, ``lightning.x._y``): only lit_fsdp/lightning_compat.py may use them
LIGHTNING_MODULE = re.compile(r"(lightning|pytorch_lightning|lightning_fabric)(\.|$)")
LIGHTNING_PRIVATE_PATH = re.compile(r"\b(lightning|pytorch_lightning|lightning_fabric)(\.\w+)*\._\w")


def requirement(name: str) -> str:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (found,) = [d for d in dependencies if re.match(rf"{name}\b(?![-_])", d)]
    return found.split("#")[0].replace(" ", "")


def test_the_range_is_the_one_pyproject_asks_for_and_the_running_torch_is_inside_it():
    floor, newest = torch_compat.TORCH_FLOOR, torch_compat.TORCH_NEWEST_TESTED
    assert requirement("torch") == f"torch>={floor[0]}.{floor[1]},<{newest[0]}.{newest[1] + 1}"
    assert floor <= torch_compat.torch_version() <= newest


def test_ci_runs_the_floor_and_the_newest_torch_the_range_admits():
    pins = re.findall(r"\btorch==(\d+)\.(\d+)\.\d+", (ROOT / ".ci" / "run").read_text())  # each environment's pin
    minors = {(int(major), int(minor)) for major, minor in pins}
    assert torch_compat.TORCH_FLOOR in minors and torch_compat.TORCH_NEWEST_TESTED in minors, pins
    assert all(torch_compat.TORCH_FLOOR <= minor <= torch_compat.TORCH_NEWEST_TESTED for minor in minors), pins


def test_lightning_is_capped_at_the_newest_minor_tested_and_the_running_one_is_inside():
    from lit_fsdp import lightning_compat

    major, minor = lightning_compat.LIGHTNING_NEWEST_TESTED
    assert requirement("lightning").endswith(f",<{major}.{minor + 1}")
    assert tuple(int(part) for part in version("lightning").split(".")[:2]) <= (major, minor)


def test_every_exported_name_exists():
    from lit_fsdp import lightning_compat

    for module in (torch_compat, lightning_compat):
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{module.__name__}.{name}"


def test_lightnings_private_names_do_what_lit_fsdp_uses_them_for(tmp_path, monkeypatch):
    from lit_fsdp import lightning_compat

    assert lightning_compat.default_process_group_backend(torch.device("cpu")) == "gloo"
    assert lightning_compat.default_process_group_backend(torch.device("cuda", 0)) == "nccl"
    assert not lightning_compat.is_sharded_checkpoint(tmp_path)
    (tmp_path / lightning_compat.METADATA_FILENAME).write_bytes(b"")
    assert lightning_compat.is_sharded_checkpoint(tmp_path) and not lightning_compat.is_sharded_checkpoint(tmp_path / "x")
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([parameter])
    parameter.grad = torch.ones(2)
    optimizer.step()
    lightning_compat.optimizers_to_device([optimizer], torch.device("cpu"))
    assert optimizer.state[parameter]["exp_avg"].device.type == "cpu"
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))  # the user's setting wins
    lightning_compat.set_num_threads_if_needed(64)
    assert torch.get_num_threads() == threads and os.environ["OMP_NUM_THREADS"] == str(threads)
    assert bool(lightning_compat.RICH_AVAILABLE) in (True, False)
    from lightning.pytorch import Trainer

    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    lightning_compat.stop_as_on_sigterm(trainer)
    assert trainer.received_sigterm  # what Lightning's loops read to stop where a step ends


def test_no_module_outside_the_compatibility_module_uses_a_private_lightning_api():
    offenders = []
    for folder in ("lit_fsdp", "compress", "callbacks", "offload", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name in ("lightning_compat.py", "test_torch_compat.py"):
                continue
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and LIGHTNING_MODULE.match(node.module or ""):
                    names = node.module.split(".") + [alias.name for alias in node.names]
                elif isinstance(node, ast.Import):
                    names = [part for alias in node.names if LIGHTNING_MODULE.match(alias.name) for part in alias.name.split(".")]
                else:
                    continue
                if any(name.startswith("_") for name in names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.get_source_segment(text, node)}")
            for number, line in enumerate(text.splitlines(), 1):
                if LIGHTNING_PRIVATE_PATH.search(line.split("#")[0]) and "monkeypatch" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "use lit_fsdp.lightning_compat instead:\n" + "\n".join(offenders)


def test_no_module_outside_the_compatibility_module_uses_a_private_torch_api():
    offenders = []
    for folder in ("lit_fsdp", "compress", "callbacks", "offload", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name in ("torch_compat.py", "test_torch_compat.py"):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if PRIVATE.search(code) and "monkeypatch" not in code:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "use compress.torch_compat instead:\n" + "\n".join(offenders)


def _collectives_without_newer_names(rank: int, world: int) -> tuple[list[int], list[float]]:
    # torch 2.11 has neither all_gather_single nor reduce_scatter_single: take them away, as the floor release does
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            delattr(dist, name)
    compat = importlib.reload(torch_compat)
    gathered = torch.empty(world * 3, dtype=torch.uint8)
    compat.all_gather_bytes(gathered, torch.full((3,), rank, dtype=torch.uint8))
    reduced = torch.empty(2)
    compat.reduce_scatter_flat(reduced, torch.arange(2.0 * world) + rank, op=dist.ReduceOp.SUM)
    return gathered.tolist(), reduced.tolist()


def test_flat_collectives_need_only_what_the_floor_release_has(tmp_path):
    results = run(_collectives_without_newer_names, tmp_path)
    for rank, (gathered, reduced) in enumerate(results):
        assert gathered == [0, 0, 0, 1, 1, 1]
        assert reduced == [4 * rank + 1, 4 * rank + 3]  # rank r's row [2r, 2r + 1] summed over inputs offset by 0 and 1


def test_bf16_counts_only_hardware_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert not torch_compat.bf16_native(torch.device("cuda"))  # a V100: emulated only
    assert not torch_compat.bf16_native(torch.device("cpu"))


def _fsdp2_with_and_without_lit_fsdps_hooks(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compress.config import CompressionConfig
    from compress.hook import GradientCompression

    mesh, results = init_device_mesh("cpu", (world,)), {}
    for config in (CompressionConfig(), CompressionConfig(method="int8", param_all_gather="int8")):
        torch.manual_seed(0)
        layer = torch.nn.Linear(256, 16)
        fully_shard(layer, mesh=mesh)
        hook = GradientCompression(config)
        hook.register(layer, mesh)  # as the strategy installs it on each FSDP module
        inputs = torch.randn(4, 256, generator=torch.Generator().manual_seed(rank))  # each rank its own batch
        layer(inputs).square().mean().backward()
        results[config.method] = (layer.weight.grad.to_local().clone(), hook.stats.take())
    return results


def test_fsdp2_calls_lit_fsdps_reduce_scatter_and_all_gather_hooks_in_this_release(tmp_path):
    # torch_compat's ReduceScatter and AllGather are FSDP2's private hook classes: this release must call the
    # subclasses lit_fsdp installs (set_custom_reduce_scatter, set_custom_all_gather) with the arguments they take.
    for per_method in run(_fsdp2_with_and_without_lit_fsdps_hooks, tmp_path):
        exact, _ = per_method["none"]
        quantised, stats = per_method["int8"]
        assert stats["calls"] >= 1 and 0 < stats["bytes_sent"] < stats["bytes_raw"]
        assert 0 < stats["gather_bytes_sent"] < stats["gather_bytes_raw"]
        assert not torch.equal(quantised, exact)  # it went through the hooks
        torch.testing.assert_close(quantised, exact, rtol=0, atol=0.02 * float(exact.abs().max()))


def test_kineto_events_and_allocation_events_read_this_releases_profiler():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.profiler.record_function("lit_fsdp_range"):
            product = torch.ones(64, 64) @ torch.ones(64, 64)
        del product
    events = torch_compat.kineto_events(prof)
    (annotation,) = [e for e in events if e["name"] == "lit_fsdp_range"]
    assert annotation["is_user_annotation"] and annotation["device_type"] == "CPU"
    (matmul,) = [e for e in events if e["name"] == "aten::mm"]
    assert annotation["start_ns"] <= matmul["start_ns"] <= matmul["end_ns"] <= annotation["end_ns"]
    assert matmul["thread_id"] == annotation["thread_id"]
    sizes = [size for _, _, size, _ in torch_compat.allocation_events(prof)]
    assert 64 * 64 * 4 in sizes and -64 * 64 * 4 in sizes  # the product allocated, then freed


class _CountedTanh(torch.nn.Module):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(x)  # saves its output for backward: a checkpoint recomputes it


def test_checkpoint_wrapper_recomputes_the_forward_in_backward():
    block = _CountedTanh()
    wrapped = torch_compat.checkpoint_wrapper(block, checkpoint_impl=torch_compat.CheckpointImpl.NO_REENTRANT)
    x = torch.ones(2, 4, requires_grad=True)
    wrapped(x).sum().backward()
    assert block.calls == 2 and torch.allclose(x.grad, 1 - torch.tanh(torch.ones(2, 4)) ** 2)


def test_a_weak_storage_reference_gives_the_storage_while_a_view_lives_and_none_once_it_is_freed():
    tensor = torch.arange(6.0)
    view = tensor[2:]
    weak = torch_compat.storage_weak_ref(view)
    del tensor
    assert weak() is not None and weak().data_ptr() == view.untyped_storage().data_ptr()  # the view keeps it
    del view
    gc.collect()
    assert weak() is None
