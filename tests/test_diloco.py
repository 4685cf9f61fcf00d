"""Semi-synchronous training: ``lit_fsdp.diloco.OuterSync`` against a reference loop written from the
DiLoCo paper, replicas identical after each synchronisation, streaming fragments, codecs and refusals."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from compress.config import CompressionConfig
from lit_fsdp.diloco import OuterConfig, OuterSync, SemiSyncConfig
from lit_fsdp.strategy import FSDP2Strategy
from lit_fsdp.errors import OneLineError
from tests.distributed import fit_in_process, run
from tests.helpers import REPO, checkpoint_every, cli_in_process, fit_arguments, read_metrics

SHAPES = [(6, 5), (5,), (5, 6)]
H, STEPS = 3, 7


def data(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch replica ``replica`` trains on at ``step``: its own data."""
    generator = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 6, generator=generator)


def initial() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def loss(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, b, w2 = params
    return ((torch.tanh(x @ w1 + b) @ w2 - y) ** 2).mean()


def inner_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, replica: int, step: int) -> None:
    optimizer.zero_grad()
    loss(params, *data(replica, step)).backward()
    optimizer.step()


def reference(replicas: int, steps: int, sync_every: int, lr: float, momentum: float) -> list[list[torch.Tensor]]:
    """DiLoCo as the paper writes it: each replica takes H AdamW steps, then the outer Nesterov SGD (torch's) steps
    theta_outer with the mean of theta_outer - theta_replica, and every replica restarts from it."""
    outer = [p.clone().requires_grad_(True) for p in initial()]
    outer_optimizer = torch.optim.SGD(outer, lr=lr, momentum=momentum, nesterov=True)
    models = [[p.clone().requires_grad_(True) for p in initial()] for _ in range(replicas)]
    optimizers = [torch.optim.AdamW(m, lr=0.05) for m in models]
    for step in range(1, steps + 1):
        for r in range(replicas):
            inner_step(models[r], optimizers[r], r, step)
        if step % sync_every == 0:
            for i, p in enumerate(outer):
                deltas = [p.detach() - models[r][i].detach() for r in range(replicas)]
                total = deltas[0].clone()
                for d in deltas[1:]:
                    total += d
                p.grad = total / replicas
            outer_optimizer.step()
            with torch.no_grad():
                for m in models:
                    for mine, o in zip(m, outer):
                        mine.copy_(o)
    return [[p.detach() for p in m] for m in models]


def _train(rank: int, world: int, outer: dict, fragments_of: list[int], steps: int) -> dict:
    params = [p.clone().requires_grad_(True) for p in initial()]
    optimizer = torch.optim.AdamW(params, lr=0.05)
    config = OuterConfig(**outer)
    fragments = [[params[i] for i in range(len(params)) if fragments_of[i] == f] for f in range(config.fragments)]
    sync = OuterSync(SemiSyncConfig(H, config), fragments, dist.new_group(backend="gloo"), torch.device("cpu"))
    after_sync = []
    for step in range(1, steps + 1):
        inner_step(params, optimizer, rank, step)
        sync.after_step()
        if step % H == 0:
            after_sync.append([p.detach().clone() for p in params])
    sync.close()
    return {"params": [p.detach() for p in params], "after_sync": after_sync, "stats": sync.stats.take(),
            "figures": asdict(sync.figures()), "outer": [f.outer.clone() for f in sync.fragments]}


# name: (outer settings, each parameter's fragment, steps); run one after another in one spawn of 3 processes
SCENARIOS = {
    "paper": ({"lr": 0.7, "momentum": 0.9}, [0, 0, 0], STEPS),
    "int4": ({"codec": {"method": "int8", "num_bits": 4}}, [0, 0, 0], 2 * H),
    "topk_ef": ({"codec": {"method": "topk", "ratio": 0.3, "error_feedback": True}}, [0, 0, 0], 2 * H),
    "streaming": ({"fragments": 2, "delay": 1, "mix": 0.5}, [0, 1, 0], 2 * H),
}


def _every_scenario(rank: int, world: int) -> dict:
    return {name: _train(rank, world, *scenario) for name, scenario in SCENARIOS.items()}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict[str, list[dict]]:
    ranks = run(_every_scenario, tmp_path_factory.mktemp("outer"), world=3)
    return {name: [r[name] for r in ranks] for name in SCENARIOS}


def test_outer_steps_equal_the_reference_loop_from_the_paper(scenarios):
    ranks = scenarios["paper"]
    expected = reference(3, STEPS, H, lr=0.7, momentum=0.9)
    for rank, result in enumerate(ranks):  # to float32 rounding: gloo's ring adds 3 replicas in another order
        for got, want in zip(result["params"], expected[rank]):
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    # a synchronisation every H steps: the fp32 ring all-reduce of every step against one of every H
    stats = ranks[0]["stats"]
    assert ranks[0]["figures"]["outer_syncs"] == STEPS // H
    assert stats["bytes_raw"] / stats["bytes_sent"] == pytest.approx(STEPS / (STEPS // H))


@pytest.mark.parametrize("codec", ["int4", "topk_ef"])
def test_three_replicas_hold_the_same_bits_after_each_synchronisation(scenarios, codec):
    ranks = scenarios[codec]
    for after in zip(*(r["after_sync"] for r in ranks)):
        for tensors in zip(*after):
            assert all(torch.equal(tensors[0], t) for t in tensors[1:])
    assert not torch.equal(ranks[0]["params"][0], initial()[0])
    stats = ranks[0]["stats"]
    assert stats["bytes_raw"] / stats["bytes_sent"] > H  # the codec's ratio on top of the H steps


def test_streaming_fragments_sync_at_staggered_steps_and_overlap_their_exchange(scenarios):
    ranks = scenarios["streaming"]
    # fragment 0 at steps 3 and 6 (applied at 4 and 7: the last still in flight at the end), fragment 1 at 1 and 4
    # (applied at 2 and 5)
    assert ranks[0]["figures"]["outer_syncs"] == 4
    for tensors in zip(*(r["outer"] for r in ranks)):
        assert all(torch.equal(tensors[0], t) for t in tensors[1:])  # theta_outer is the same on every replica
    assert not torch.equal(ranks[0]["params"][1], ranks[1]["params"][1])  # local weights are mixed: they differ
    assert 0 <= ranks[0]["figures"]["outer_hidden_share"] <= 1


@pytest.mark.parametrize(("outer", "message"), [
    ({"lr": 0}, "give lr > 0 and momentum and mix in [0, 1)"),
    ({"fragments": 0}, "give fragments >= 1 and delay >= 0"),
    ({"delay": 1, "state_device": "device"}, "needs state_device cpu"),
    ({"codec": {"method": "powersgd"}}, "cannot average pseudo-gradients across replicas; choose one of none"),
    ({"codec": {"method": "int8", "ratio": 0.1}}, "compression parameter ratio does not apply to method 'int8'"),
])
def test_impossible_outer_settings_are_one_line(outer, message):
    with pytest.raises((OneLineError, ValueError), match=None) as caught:
        OuterConfig(**outer)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(("outer", "message"), [
    ({"fragments": 4}, "fragments=4 exceeds sync_every=3"),
    ({"delay": 3}, "give delay < sync_every"),
])
def test_outer_settings_that_do_not_fit_sync_every_are_one_line(outer, message):
    with pytest.raises(OneLineError, match=message):
        SemiSyncConfig(H, OuterConfig(**outer))


# --- through the strategy and the CLI -------------------------------------------------------------------------

STRATEGY = "--trainer.strategy.init_args"
RECORDS = [{"class_path": "callbacks.CompressionStats"}, {"class_path": "callbacks.Results"}]  # results.jsonl


class DigestsAfterSteps(pl.Callback):
    """After every optimizer step, a SHA-256 of each of this rank's parameter shards; written to ``<path>.rank<r>``."""

    def __init__(self, path: str):
        self.path, self.steps = path, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[trainer.global_step] = [
            hashlib.sha256(p.to_local().detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for p in pl_module.model.parameters()]

    def on_train_end(self, trainer, pl_module):
        Path(f"{self.path}.rank{trainer.global_rank}").write_text(json.dumps(self.steps))


def test_three_replicas_of_a_run_are_bit_identical_right_after_each_synchronisation(tmp_path):
    """NO_SHARD on 3 processes, each its own replica on its own data, int8 at 4 bits, a synchronisation every 3 steps."""
    probe = {"class_path": f"{__name__}.DigestsAfterSteps", "init_args": {"path": str(tmp_path / "digests")}}
    arguments = fit_arguments(tmp_path, "--config", str(REPO / "configs" / "diloco.yaml"), f"{STRATEGY}.sync_every", "3",
                              "--trainer.devices", "3", steps=7,
                              callbacks=[probe, *RECORDS])
    run(fit_in_process, tmp_path, [arguments], world=3)
    ranks = [json.loads(Path(f"{tmp_path / 'digests'}.rank{r}").read_text()) for r in range(3)]
    for step in ("3", "6", "7"):  # 7: the run ends on a synchronisation
        assert ranks[0][step] == ranks[1][step] == ranks[2][step], f"replicas differ after the synchronisation at {step}"
    for step in ("1", "2", "4", "5"):  # between synchronisations each replica follows its own data
        assert ranks[0][step] != ranks[1][step] != ranks[2][step]
    record = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    assert record["strategy"] == "fsdp2_no_shard_diloco3" and record["outer_syncs"] == 3
    # 7 steps of a per-step fp32 ring all-reduce against 3 exchanges (at 3, 6 and the end) of 4-bit values (one fp32
    # scale per 1024): all-gathered over 3 replicas, each sends 2 of its payloads for 4/3 of the values in fp32
    assert record["compression_ratio"] == pytest.approx(7 / 3 * (4 / 3 * 4) / (2 * (0.5 + 4 / 1024)), rel=0.02)



def test_hybrid_shard_trains_fsdp2_inside_each_replica_group_and_synchronises_the_groups(tmp_path):
    """HYBRID_SHARD 2 x 2 on 4 processes: ranks 0, 1 are replica 0's two shards, ranks 2, 3 replica 1's. Inner steps
    reduce inside a group only, so the groups differ between synchronisations; right after one (at 3, and the run's
    end at 4), each shard equals the same shard of the other group."""
    probe = {"class_path": f"{__name__}.DigestsAfterSteps", "init_args": {"path": str(tmp_path / "digests")}}
    arguments = fit_arguments(tmp_path, "--config", str(REPO / "configs" / "diloco.yaml"), f"{STRATEGY}.sync_every", "3",
                              f"{STRATEGY}.sharding", "HYBRID_SHARD", f"{STRATEGY}.replicate_size", "2",
                              "--trainer.devices", "4", steps=4, callbacks=[probe, *RECORDS])
    run(fit_in_process, tmp_path, [arguments], world=4)
    ranks = [json.loads(Path(f"{tmp_path / 'digests'}.rank{r}").read_text()) for r in range(4)]
    for step in ("3", "4"):  # 4: the run ends on a synchronisation
        assert ranks[0][step] == ranks[2][step] and ranks[1][step] == ranks[3][step], f"the groups differ after {step}"
    assert ranks[0]["3"] != ranks[1]["3"]  # each rank holds its own shard
    for step in ("1", "2"):
        assert ranks[0][step] != ranks[2][step] and ranks[1][step] != ranks[3][step]
    record = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    assert record["strategy"] == "fsdp2_hybrid_shard_diloco3" and record["outer_syncs"] == 2

CONFIGS = ("diloco.yaml", "diloco_streaming.yaml")


class WeightsAndOuter(pl.Callback):
    """Writes ``<path>.rank<r>``: each parameter's float64 sum when training starts and ends, and whether theta_outer
    equals the weights when it starts."""

    def __init__(self, path: str):
        self.path, self.record = path, {}

    @staticmethod
    def sums(pl_module) -> list[float]:
        return [float(p.full_tensor().double().sum()) for p in pl_module.model.parameters()]

    def on_train_start(self, trainer, pl_module):
        semi_sync = getattr(trainer.strategy, "semi_sync", None)
        sync = None if semi_sync is None else semi_sync.outer_sync
        self.record = {"start": self.sums(pl_module), "outer_is_weights": None if sync is None else all(
            torch.equal(f.outer, f.local_flat(f.outer.device)) for f in sync.fragments)}

    def on_train_end(self, trainer, pl_module):
        Path(f"{self.path}.rank{trainer.global_rank}").write_text(json.dumps({**self.record, "end": self.sums(pl_module)}))


@pytest.fixture(scope="module")
def config_runs(tmp_path_factory) -> Path:
    """Both configs, 8 steps each with a synchronisation every 4, on 2 processes; then a fully synchronous run of 3
    steps (FULL_SHARD) continued by ``configs/diloco.yaml`` to step 7 (one spawn, the CLI in-process)."""
    root = tmp_path_factory.mktemp("configs")
    runs = [fit_arguments(root / config, "--config", str(REPO / "configs" / config), f"{STRATEGY}.sync_every", "4",
                          steps=8, callbacks=RECORDS) for config in CONFIGS]
    probe = {"class_path": f"{__name__}.WeightsAndOuter"}
    runs.append(fit_arguments(root / "synchronous", steps=3, callbacks=[
        checkpoint_every(3, root / "synchronous" / "checkpoints"),
        {**probe, "init_args": {"path": str(root / "synchronous" / "weights")}}]))
    runs.append(fit_arguments(root / "continued", "--config", str(REPO / "configs" / "diloco.yaml"),
                              f"{STRATEGY}.sync_every", "2", "--ckpt_path", str(root / "synchronous" / "checkpoints" / "last.ckpt"),
                              steps=7, callbacks=[{**probe, "init_args": {"path": str(root / "continued" / "weights")}}, *RECORDS]))
    runs.append(fit_arguments(root / "device_state", "--config", str(REPO / "configs" / "diloco.yaml"),
                              f"{STRATEGY}.sync_every", "4", f"{STRATEGY}.outer", "{state_device: device}", steps=8,
                              callbacks=[{**probe, "init_args": {"path": str(root / "device_state" / "weights")}}, *RECORDS]))
    run(fit_in_process, root, runs)
    return root


def test_the_outer_state_on_the_device_exchanges_in_line_over_the_meshs_replicate_group(config_runs):
    """``state_device: device`` (on CPU processes the device is the host, so this checks the group and the in-line
    exchange, not CUDA): synchronised at steps 4 and 8, the replicas end identical."""
    ends = [json.loads((config_runs / "device_state" / f"weights.rank{rank}").read_text())["end"] for rank in range(2)]
    assert ends[0] == ends[1]
    record = json.loads((config_runs / "device_state" / "results.jsonl").read_text().splitlines()[-1])
    assert record["outer"]["state_device"] == "device" and record["outer_syncs"] == 2 and not record["outer_wait_s"]


def test_a_fully_synchronous_checkpoint_continues_semi_synchronously_from_its_weights(config_runs):
    """Every replica and theta_outer start from the checkpoint's weights; the replicas synchronise every 2 steps
    from there (after steps 5 and 7)."""
    for rank in range(2):
        synchronous = json.loads((config_runs / "synchronous" / f"weights.rank{rank}").read_text())
        continued = json.loads((config_runs / "continued" / f"weights.rank{rank}").read_text())
        assert continued["start"] == synchronous["end"] and continued["outer_is_weights"]
        assert continued["end"] != continued["start"]
    record = json.loads((config_runs / "continued" / "results.jsonl").read_text().splitlines()[-1])
    assert record["outer_syncs"] == 2 and record["strategy"] == "fsdp2_no_shard_diloco2"


@pytest.mark.parametrize("config", CONFIGS)
def test_the_diloco_configs_train_on_two_processes(config_runs, config):
    folder = config_runs / config
    losses = read_metrics(max(folder.glob("lightning_logs/version_*/metrics.csv")))["train/loss"]
    record = json.loads((folder / "results.jsonl").read_text().splitlines()[-1])
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses) and record["world_size"] == 2
    # streaming: fragment 0 at steps 4 and 8, fragment 1 at 1 and 5, fragment 2 at 2 and 6; the run's end applies
    # fragment 0's average in flight and exchanges fragments 1 and 2 once more
    assert record["outer_syncs"] == (2 if config == "diloco.yaml" else 8)
    # 4-bit values (7.9x) every 4 steps; streaming's final exchange of fragments 1 and 2 makes 8 / 3 whole exchanges
    assert record["compression_ratio"] > (4 if config == "diloco.yaml" else 3) * 7


@pytest.mark.parametrize(("settings", "processes", "message"), [
    ({"sync_every": -1}, 2, "sync_every=-1: give the optimizer steps between synchronisations"),
    ({"sync_every": 4}, 2, "FULL_SHARD on 2 process(es) has no replicate dimension"),
    ({"sync_every": 4, "sharding": "HYBRID_SHARD", "replicate_size": 1}, 2, "has one replica"),
    ({"sync_every": 4, "sharding": "NO_SHARD"}, 1, "NO_SHARD on 1 process(es) has one replica"),
    ({"sync_every": 4, "sharding": "NO_SHARD", "compression": CompressionConfig(method="int8")}, 2,
     "a per-step compression hook cannot take part in"),
    ({"sync_every": 4, "sharding": "NO_SHARD", "outer": {"fragments": 8}}, 2, "fragments=8 exceeds sync_every=4"),
    ({"outer": {"lr": 0.5}}, 2, "outer sets the outer step of semi-synchronous training; set sync_every too"),
    ({"sync_every": 4, "sharding": "NO_SHARD", "save_distributed_checkpoint": False}, 2,
     "keep save_distributed_checkpoint true"),
])
def test_what_semi_synchronous_training_cannot_do_is_refused_in_one_line(settings, processes, message):
    """The strategy's own checks, which the CLI's preflight runs before any worker starts (as the next test shows)."""
    with pytest.raises((ValueError, OneLineError)) as caught:
        FSDP2Strategy(**settings).mesh_shape(processes, 1)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_more_fragments_than_fsdp_units_is_refused_before_any_worker_starts(tmp_path):
    # in this process: cli_in_process fails the test where a process group starts or training is reached
    done = cli_in_process(*fit_arguments(tmp_path, "--config", str(REPO / "configs" / "diloco_streaming.yaml"),
                                         f"{STRATEGY}.outer.fragments", "4"), cwd=tmp_path)
    assert done.returncode == 2
    assert "fragments=4 exceeds the model's 3 FSDP units (its blocks' and the root)" in done.stderr


def test_estimate_counts_the_outer_state_on_the_host_and_the_exchange_over_its_steps(tmp_path, capsys):
    """Llama-8B, 2 nodes x 8 H100s, HYBRID_SHARD: each rank keeps theta_outer and momentum (8 B) and one pseudo-gradient
    in flight (4 B) per parameter of its shard, and sends a 4-bit payload to the other replica every 32 steps."""
    from lit_fsdp.commands.estimate import main

    hardware = json.loads((REPO / "configs" / "hardware" / "h100_128g.json").read_text())
    hardware.update(nodes=2, devices_per_node=8, host_memory_gb=1024, intra_node_gbps=450, inter_node_gbps=1.25)
    (tmp_path / "h100x16.json").write_text(json.dumps(hardware))
    shape = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model.preset", "llama-8b",
             "--trainer.accelerator", "gpu", "--trainer.num_nodes", "2", "--trainer.devices", "8",
             f"{STRATEGY}.sharding", "HYBRID_SHARD", f"{STRATEGY}.param_dtype", "bfloat16",
             "--data.init_args.vocab_size", "128256", "--data.init_args.seq_len", "2048",
             "--tune.hardware", str(tmp_path / "h100x16.json"), "--json"]
    main(shape)
    synchronous = json.loads(capsys.readouterr().out)
    main([*shape, f"{STRATEGY}.sync_every", "32", f"{STRATEGY}.outer", "{codec: {method: int8, num_bits: 4}}"])
    figures = json.loads(capsys.readouterr().out)
    shard = -(-figures["trained_parameters"] // 8)
    assert figures["host_by_buffer"]["outer_state"] == 8 * 12 * shard
    # 4 bits and an fp32 scale per 1024 values, to the one other replica, over 32 steps; against a ring all-reduce
    assert figures["network_bytes"]["all_reduce"] == pytest.approx(shard * (0.5 + 4 / 1024) / 32, rel=1e-3)
    assert synchronous["network_bytes"]["all_reduce"] == pytest.approx(2 * 4 * shard / 2, rel=1e-3)
    assert figures["times"]["network_s"] < synchronous["times"]["network_s"]


def test_a_codec_parameter_the_config_left_is_named_in_one_line(capsys):
    """A command-line ``outer`` merges into the config's: diloco.yaml's num_bits 4 stays beside method none. The
    error sits two Unions deep in jsonargparse's message (the strategy's, then ``outer``'s); the line names it."""
    from lit_fsdp.commands.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--config", str(REPO / "configs" / "quickstart.yaml"), "--config",
              str(REPO / "configs" / "diloco.yaml"), f"{STRATEGY}.outer", "{codec: {method: none}}"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    assert "compression parameter num_bits does not apply to method 'none'; it takes no parameters" in errors[0]
