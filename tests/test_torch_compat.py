"""The torch compatibility module: the floor it states, what it provides, and that nothing else reaches past it."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist

from compress import torch_compat
from tests.distributed import run

ROOT = Path(__file__).resolve().parents[1]
#: private or version-sensitive torch names: only compress/torch_compat.py may use them
PRIVATE = re.compile(r"_fsdp_api|algorithms\._checkpoint|kineto_results|all_gather_single|reduce_scatter_single|is_bf16_supported\(|"
                     r"torch\.distributed\.fsdp\._")


def test_the_floor_is_the_one_pyproject_asks_for_and_the_running_torch_meets_it():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_requirement,) = [d for d in dependencies if re.match(r"torch\b", d)]
    assert torch_requirement.replace(" ", "") == "torch>={}.{}".format(*torch_compat.TORCH_FLOOR)
    assert torch_compat.torch_version() >= torch_compat.TORCH_FLOOR


def test_every_exported_name_exists():
    for name in torch_compat.__all__:
        assert getattr(torch_compat, name) is not None, name


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
