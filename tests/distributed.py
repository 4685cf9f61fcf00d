"""Run a function on 2 gloo processes inside a test and collect what each rank returns.

Ranks are forked from a forkserver that has imported torch, Lightning, transformers and lit_fsdp once per pytest
worker (2.8 to 5.3 s of imports a rank otherwise pays again on 2 cores); each starts from those modules as imported,
with the test's environment and working directory, as a spawned process would."""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the forkserver imports before it forks a rank: what every rank would import first.
PRELOAD = ["torch", "torch.distributed.fsdp", "lightning.pytorch", "transformers", "lit_fsdp.commands.cli",
           "lit_fsdp.model", "offload.strategy", "tests.helpers",
           # the mixture-of-experts families the tests train (6 to 10 s of a first import in each spawn otherwise)
           "transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.mixtral.modeling_mixtral"]
multiprocessing.set_forkserver_preload(PRELOAD)


def _worker(rank: int, world: int, port: int, fn: Callable, out: str, args: tuple, environ: dict[str, str],
            cwd: str) -> None:
    os.environ.clear()  # the test's environment and folder, not the forkserver's (started by an earlier test)
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(cwd)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), f"{out}.{rank}")
    finally:
        # FSDP2's modules sit in reference cycles: collected at interpreter exit, after the group is gone, torch 2.14.1
        # aborts ("terminate called without an active exception") in about one spawn in 15. Collect them first.
        gc.collect()
        dist.destroy_process_group()


def in_process_cli(rank: int, world: int) -> Callable[[list[str]], object]:
    """The CLI's ``run`` for ``fit`` runs inside this spawned rank, one after another (a CLI process per run costs
    about 20 s on 2 cores); Lightning launches no process."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    from lit_fsdp.commands.cli import run as cli

    return cli


def fit_in_process(rank: int, world: int, runs: list[list[str]]) -> None:
    """Each of ``runs`` (``fit`` arguments) through the CLI in this rank, in order: ``run(fit_in_process, tmp, runs)``."""
    cli = in_process_cli(rank, world)
    for arguments in runs:
        cli(arguments)


def run(fn: Callable, tmp_path: Path, *args, world: int = 2, fresh: bool = False, cwd: Path | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes in ``cwd`` (default: the test's); returns the per-rank results
    (must be picklable). ``fresh``: each rank a new interpreter that has imported nothing yet (``spawn``), for a test
    of what happens at import."""
    out = str(tmp_path / "result")
    mp.start_processes(_worker, args=(world, free_port(), fn, out, args, dict(os.environ), str(cwd or Path.cwd())),
                       nprocs=world, join=True, start_method="spawn" if fresh else "forkserver")
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]
