"""The multi-node command of docs/usage.md: two torchrun agents with c10d rendezvous on this machine stand for two
nodes of 2 CPU processes each, with configs/multinode_hybrid.yaml (HYBRID_SHARD: shard within a node, replicate
across nodes); every rank ends with the same loss, and replicas of a shard hold the same weights."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl

from tests.distributed import free_port
from tests.helpers import REPO, read_metrics

STEPS = 4


class RankRecord(pl.Callback):
    """At the end of fit, each rank writes ``<folder>/rank<r>.json``: its node, the loss logged last (the mean over
    every rank's batch) and a digest of its parameter shards."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        digest = hashlib.sha256()
        for parameter in pl_module.model.parameters():
            digest.update(parameter.detach().to_local().contiguous().numpy().tobytes())
        record = {"node": int(os.environ["GROUP_RANK"]), "world": trainer.world_size,
                  "mesh": list(trainer.strategy.device_mesh.shape),
                  "loss": float(trainer.callback_metrics["train/loss"]), "shards": digest.hexdigest()}
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def documented_command() -> list[str]:
    """docs/usage.md's torchrun command for two nodes (two lines), as written there."""
    usage = (REPO / "docs" / "usage.md").read_text()
    return re.search(r"^torchrun --nnodes 2 .*\\\n.*$", usage, re.M).group(0).replace("\\\n", " ").split()


def test_two_torchrun_agents_with_c10d_rendezvous_train_hybrid_shard_to_the_same_loss_on_every_rank(tmp_path):
    command = documented_command()
    assert "configs/multinode_hybrid.yaml" in command and "c10d" in command
    # On one machine's CPUs (docs/usage.md says so): 2 processes per agent, the endpoint on this machine, the
    # quickstart's tiny model for a few steps (configs/gpt2_124m.yaml, a GPU config, left out).
    node_flags, cli = command[1:command.index("-m")], command[command.index("-m"):]
    node_flags[node_flags.index("--nproc-per-node") + 1] = "2"
    node_flags[node_flags.index("--rdzv-endpoint") + 1] = f"127.0.0.1:{free_port()}"
    del cli[cli.index("configs/gpt2_124m.yaml") - 1:cli.index("configs/gpt2_124m.yaml") + 1]
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text(json.dumps({"trainer": {"callbacks": [
        {"class_path": f"{__name__}.RankRecord", "init_args": {"folder": str(tmp_path)}}]}}))
    overrides = ["--config", str(callbacks), "--trainer.devices", "2", "--trainer.max_steps", str(STEPS),
                 "--trainer.log_every_n_steps", "1", "--data.batch_size", "2", "--trainer.limit_val_batches", "0",
                 "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
                 "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path),
                 "--trainer.default_root_dir", str(tmp_path)]
    command = [str(Path(sys.executable).with_name("torchrun")), *node_flags, *cli, *overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    agents = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(output[-3000:] for output in outputs)

    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert [r["node"] for r in ranks] == [0, 0, 1, 1] and {r["world"] for r in ranks} == {4}
    assert all(r["mesh"] == [2, 2] for r in ranks)  # (replicate across nodes, shard within one)
    assert len({r["loss"] for r in ranks}) == 1
    assert ranks[0]["shards"] == ranks[2]["shards"] != ranks[1]["shards"] == ranks[3]["shards"]
    losses = read_metrics(max(tmp_path.glob("lightning_logs/version_*/metrics.csv")))["train/loss"]
    assert len(losses) == STEPS and losses[-1] == ranks[0]["loss"]
