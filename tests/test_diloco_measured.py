"""Semi-synchronous training measured fairly: a run ends on a synchronisation and its byte ratio is what the
collectives moved; validation scores the replicas' average; SparseLoCo as published against a reference written from
the paper; 16-bit pseudo-gradients added in float32."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import compress.communicator as communicator
from compress.communicator import CommStats, CompressedAllReduce
from compress.config import CompressionConfig
from lit_fsdp.diloco import OuterConfig, OuterSync, SemiSyncConfig
from tests.distributed import fit_in_process, run
from tests.helpers import REPO, fit_arguments
from tests.test_diloco import STRATEGY, initial, inner_step

H = 3


# --- the reference written from SparseLoCo's paper (arXiv 2508.15706, Algorithm 1) -------------------------------


def sparseloco_reference(residual: torch.Tensor, delta: torch.Tensor, chunk: int, k: int, beta: float,
                         bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e = beta e + delta; in every chunk the k largest |e|, each sent as the nearest of 2^bits levels spread evenly
    over +-(the chunk's largest kept |e|); e -= what was sent. Returns (the new e, what was sent)."""
    e = beta * residual + delta
    sent = torch.zeros_like(e)
    for start in range(0, e.numel(), chunk):
        part = e[start : start + chunk]
        kept = part.abs().topk(min(k, part.numel())).indices
        levels = torch.linspace(-1, 1, 2**bits) * part[kept].abs().max()
        sent[start + kept] = levels[(part[kept, None] - levels).abs().argmin(1)]
    return e - sent, sent


def test_sparseloco_sends_what_the_papers_top_k_of_a_decayed_accumulator_in_2_bits_sends():
    """Three calls on 2.2 chunks of 512 (the last one short), k 16, beta 0.95, 2 bits: the decoded payload and the
    accumulator equal the reference's; the payload holds 9-bit positions (log2 512), 2-bit codes and a scale per chunk."""
    codec = CompressionConfig(method="sparseloco", chunk_size=512, k=16).build(rank=0)
    residual = torch.zeros(1124)
    generator = torch.Generator().manual_seed(0)
    for call in range(3):
        delta = torch.randn(1124, generator=generator)
        residual, expected = sparseloco_reference(residual, delta, chunk=512, k=16, beta=0.95, bits=2)
        payload = codec.compress(delta, "fragment", call)
        torch.testing.assert_close(codec.decompress(payload), expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(codec.residuals["fragment"], residual, rtol=1e-6, atol=1e-6)
        assert payload.kept == 48 and (codec.decompress(payload) != 0).sum() == 48
        # 48 positions of 9 bits (a byte and 1 bit), 48 2-bit codes, 3 float32 scales
        assert payload.nbytes == 48 + 6 + 12 + 3 * 4


def test_sparseloco_at_the_papers_setting_sends_1_8125_bytes_per_kept_value():
    """64 of every 4,096 values: 12-bit positions, 2-bit values, a float32 scale per 64 values: 14.5 bits."""
    codec = CompressionConfig(method="sparseloco").build(rank=0)
    assert (codec.chunk_size, codec.k, codec.decay, codec.num_bits, codec.index_bits) == (4096, 64, 0.95, 2, 12)
    payload = codec.compress(torch.randn(4 * 4096), "x", 0)
    assert payload.kept == 256 and payload.nbytes == 256 * 1.8125 == 256 * codec.bytes_per_kept()


@pytest.mark.parametrize(("settings", "message"), [
    ({"chunk_size": 256}, "chunk_size=256 is not accepted; expected an integer in [257, 65536]"),
    ({"k": 5000}, "k=5000 is not accepted; expected an integer in [1, 4096]"),
    ({"decay": 1.5}, "decay=1.5 is not accepted; expected a number in [0, 1]"),
    ({"error_feedback": True}, "error_feedback needs a biased method; 'sparseloco' is built with its own error feedback"),
])
def test_impossible_sparseloco_settings_are_one_line(settings, message):
    with pytest.raises(ValueError) as caught:
        CompressionConfig(method="sparseloco", **settings).build(rank=0)
    assert message in str(caught.value) and "\n" not in str(caught.value)


# --- the outer synchronisation in spawned processes ---------------------------------------------------------------


class CountedBytes:
    """What this rank's collectives sent: each gathered payload to every other rank, a ring all-reduce's share."""

    def __init__(self, monkeypatch_targets: list[tuple[object, str]]):
        self.sent = 0
        for owner, name in monkeypatch_targets:
            setattr(owner, name, self._wrap(getattr(owner, name), name))

    def _wrap(self, fn, name):
        def counted(*args, group=None, **kwargs):
            world = (group or dist.group.WORLD).size()
            tensor = args[1] if name == "all_gather_bytes" else args[0]
            share = (world - 1) if name == "all_gather_bytes" else 2 * (world - 1) / world
            self.sent += round(share * tensor.numel()) * tensor.element_size()
            return fn(*args, group=group, **kwargs)
        return counted


def _outer_run(rank: int, outer: dict, fragments_of: list[int], steps: int) -> dict:
    """``steps`` inner AdamW steps on this rank's own data, a synchronisation every H, and the run's end."""
    counted = CountedBytes([(communicator, "all_gather_bytes"), (dist, "all_reduce")])
    params = [p.clone().requires_grad_(True) for p in initial()]
    optimizer = torch.optim.AdamW(params, lr=0.05)
    config = OuterConfig(**outer)
    fragments = [[params[i] for i in range(len(params)) if fragments_of[i] == f] for f in range(config.fragments)]
    sync = OuterSync(SemiSyncConfig(H, config), fragments, dist.new_group(backend="gloo"), torch.device("cpu"))
    for step in range(1, steps + 1):
        inner_step(params, optimizer, rank, step)
        sync.after_step()
    before = [p.detach().clone() for p in params]
    sync.end_on_synchronisation()
    sync.end_on_synchronisation()  # once per step: a second call (the strategy's at on_train_end) sends nothing
    checkpoint = sync.state_dict()
    sync.close()
    return {"params": [p.detach().clone() for p in params], "before": before, "stats": sync.stats.take(),
            "figures": asdict(sync.figures()), "counted": counted.sent, "checkpoint_steps": int(checkpoint["steps"]),
            "checkpoint_syncs": int(checkpoint["syncs"])}


def _bf16_average(rank: int) -> torch.Tensor:
    """Replica 0 sends 1.0, replica 1 2^-8 (both exact in bfloat16): their float32 mean is 0.501953125, a sum in
    bfloat16 rounds it to 0.5 (a tie, to even)."""
    reducer = CompressedAllReduce(CompressionConfig(method="bf16").build(rank), CommStats(), "outer0",
                                  dist.new_group(backend="gloo"))
    values = torch.full((4,), 1.0 if rank == 0 else 2.0**-8)
    reducer(values)
    return values


# name: (outer settings, each parameter's fragment, steps); 7 steps: the last synchronisation at 6, one step after it
SCENARIOS = {
    "int4": ({"codec": {"method": "int8", "num_bits": 4}}, [0, 0, 0], 7),
    # fragment 0 sent at 3 and 6 (applied at 4 and 7), fragment 1 at 1 and 4: at the end of step 6, fragment 0's
    # average is in flight and fragment 1 trained 2 steps since it was sent
    "streaming": ({"fragments": 2, "delay": 1, "mix": 0.5, "codec": {"method": "int8", "num_bits": 4}}, [0, 1, 0], 6),
    "sparseloco": ({"lr": 1.0, "momentum": 0.0, "codec": {"method": "sparseloco", "chunk_size": 512, "k": 8}},
                   [0, 0, 0], 6),
}


def _every_scenario(rank: int, world: int) -> dict:
    results = {name: _outer_run(rank, *scenario) for name, scenario in SCENARIOS.items()}
    return {**results, "bf16": _bf16_average(rank)}


@pytest.fixture(scope="module")
def outer_runs(tmp_path_factory) -> dict[str, list]:
    ranks = run(_every_scenario, tmp_path_factory.mktemp("outer_end"))
    return {name: [r[name] for r in ranks] for name in (*SCENARIOS, "bf16")}


@pytest.mark.parametrize("scenario", ["int4", "streaming"])
def test_a_run_ends_on_a_synchronisation_and_its_ratio_is_over_the_bytes_the_collectives_moved(outer_runs, scenario):
    ranks = outer_runs[scenario]
    for got, other in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(got, other), "the replicas differ at the end of the run"
    assert any(not torch.equal(a, b) for a, b in zip(ranks[0]["before"], ranks[1]["before"]))  # they did before it
    for rank in ranks:
        stats = rank["stats"]
        assert stats["bytes_sent"] == rank["counted"] > 0
        assert stats["bytes_raw"] / stats["bytes_sent"] == pytest.approx(stats["bytes_raw"] / rank["counted"], rel=0)
    if scenario == "int4":  # 7 steps, synchronisations at 3 and 6 and the final one: 3 exchanges of 4-bit values
        assert ranks[0]["figures"]["outer_syncs"] == 3
        # 65 values: a per-step fp32 ring all-reduce sends 65 x 4 bytes; a synchronisation 33 bytes of 4-bit values and
        # one fp32 scale to the other replica
        assert ranks[0]["stats"]["bytes_raw"] / ranks[0]["stats"]["bytes_sent"] == 7 * 65 * 4 / (3 * (33 + 4))
    else:  # fragment 0 at 3 and 6 (its average applied early at the end), fragment 1 at 1, 4 and once more
        assert ranks[0]["figures"]["outer_syncs"] == 5


@pytest.mark.parametrize("scenario", ["int4", "streaming"])
def test_a_checkpoint_after_the_final_synchronisation_keeps_the_state_from_before_it(outer_runs, scenario):
    """So a run extended past its max_steps continues as the uninterrupted run (tests/test_exact_resume.py)."""
    _, _, steps = SCENARIOS[scenario]
    rank = outer_runs[scenario][0]
    # the final synchronisation exchanged one fragment (int4: the model; streaming: fragment 1 only, fragment 0's
    # average was in flight)
    assert rank["checkpoint_steps"] == steps and rank["checkpoint_syncs"] == rank["figures"]["outer_syncs"] - 1


def test_sparseloco_outer_steps_equal_the_papers_loop(outer_runs):
    """2 replicas, H 3, 6 steps, outer lr 1 without momentum, the 65 parameters in one short chunk, k 8, beta 0.95,
    2 bits; each replica's accumulator is its own. The end adds no synchronisation (6 is a multiple of H)."""
    replicas, lr = 2, 1.0
    outer = [p.clone() for p in initial()]
    models = [[p.clone().requires_grad_(True) for p in initial()] for _ in range(replicas)]
    optimizers = [torch.optim.AdamW(m, lr=0.05) for m in models]
    residuals = [torch.zeros(65) for _ in range(replicas)]
    for step in range(1, 7):
        for r in range(replicas):
            inner_step(models[r], optimizers[r], r, step)
        if step % H == 0:
            flat_outer = torch.cat([p.reshape(-1) for p in outer])
            sent = []
            for r in range(replicas):
                delta = flat_outer - torch.cat([p.detach().reshape(-1) for p in models[r]])
                residuals[r], mine = sparseloco_reference(residuals[r], delta, chunk=512, k=8, beta=0.95, bits=2)
                sent.append(mine)
            flat_outer = flat_outer - lr * (sent[0] + sent[1]) / replicas
            outer = list(torch.split(flat_outer, [p.numel() for p in outer]))
            outer = [o.view_as(p) for o, p in zip(outer, initial())]
            with torch.no_grad():
                for model in models:
                    for mine, o in zip(model, outer):
                        mine.copy_(o)
    for rank in outer_runs["sparseloco"]:
        for got, want in zip(rank["params"], outer):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert rank["figures"]["outer_syncs"] == 2
        # 8 kept of 65: 8 positions (a byte and 1 bit each), 8 2-bit codes and one scale: 1 + 2/8 ... per value
        assert rank["figures"]["outer_bytes_per_value"] == pytest.approx((8 + 1 + 2 + 4) / 8)


def test_16_bit_pseudo_gradients_are_added_in_float32(outer_runs):
    for values in outer_runs["bf16"]:
        assert torch.equal(values, torch.full((4,), 0.501953125))


# --- validation through the CLI -----------------------------------------------------------------------------------


def _rows(folder: Path) -> list[dict[str, str]]:
    with open(max(folder.glob("lightning_logs/version_*/metrics.csv"))) as f:
        return list(csv.DictReader(f))


def _by_step(rows: list[dict[str, str]], column: str) -> dict[int, float]:
    return {int(row["step"]): float(row[column]) for row in rows if row.get(column)}


@pytest.fixture(scope="module")
def validated(tmp_path_factory) -> Path:
    """configs/diloco.yaml on 2 processes, a synchronisation every 4 steps, 8 steps, validation every 2 on 4 batches
    per rank; and the quickstart's synchronous run with the same validation (one spawn)."""
    root = tmp_path_factory.mktemp("validated")
    validation = ["--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "4",
                  "--trainer.num_sanity_val_steps", "0"]
    runs = [fit_arguments(root / "diloco", "--config", str(REPO / "configs" / "diloco.yaml"), f"{STRATEGY}.sync_every",
                          "4", *validation, steps=8),
            fit_arguments(root / "synchronous", *validation, steps=4)]
    run(fit_in_process, root, runs)
    return root


def test_validation_between_synchronisations_scores_the_replicas_last_average(validated):
    """Steps 4 and 6 score the same model, the average of step 4 (on every rank's share: the whole set), whatever the
    replicas learnt since; each replica's own score goes to val/loss_replica, which right after a synchronisation is
    the same model's."""
    rows = _rows(validated / "diloco")
    averaged, replica = _by_step(rows, "val/loss"), _by_step(rows, "val/loss_replica")
    assert sorted(averaged) == sorted(replica) == [1, 3, 5, 7]  # Lightning logs validation at the step before
    assert averaged[5] == averaged[3] and averaged[7] != averaged[5]  # step 8 ended on a synchronisation
    assert replica[5] != averaged[5]
    assert replica[3] == pytest.approx(averaged[3], rel=1e-6) and replica[7] == pytest.approx(averaged[7], rel=1e-6)
    assert _by_step(rows, "val/ppl_replica")[5] == pytest.approx(torch.tensor(replica[5]).exp().item(), rel=1e-6)


def test_synchronous_validation_logs_no_replica_score(validated):
    rows = _rows(validated / "synchronous")
    assert _by_step(rows, "val/loss") and not any(row.get("val/loss_replica") for row in rows)
    assert "val/loss_replica" not in rows[0]
