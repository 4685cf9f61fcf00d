"""Run a function on 2 gloo processes inside a test and collect what each rank returns."""

from __future__ import annotations

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


def _worker(rank: int, world: int, port: int, fn: Callable, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def run(fn: Callable, tmp_path: Path, *args, world: int = 2) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the per-rank results (must be picklable)."""
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(world, free_port(), fn, out, args), nprocs=world, join=True)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]
