"""0/1 Adam on FSDP2: its rounds, the owner's local steps and their correction at a sync, the bound.

Runs of the CLI (the first rounds, resume inside a local period) are at the end; the refusal of local rounds with
replicas before launch is in tests/test_cli.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from compress.communicator import CommStats
from compress.config import CompressionConfig
from compress.onebit_adam import OneBitAdam
from compress.onebit_communicator import OneBitAdamReduceScatter
from compress.onebit_momentum import EXACT, LOCAL, ONEBIT, SYNC, OneBitMomentum, ZeroOnePhase
from tests.distributed import run
from tests.helpers import SHARD, fit, gradient

KNOB = "--trainer.strategy.init_args.compression"


def test_variance_rounds_double_their_interval_and_syncs_follow_the_local_schedule():
    phase = ZeroOnePhase(var_freeze_step=20, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
    kinds = [phase.kind(step) for step in range(40)]
    assert [s for s, k in enumerate(kinds) if k == EXACT] == [0, 1, 3, 5, 9, 13]  # intervals 1, 1, 2, 2, 4, 4
    assert all(k == ONEBIT for s, k in enumerate(kinds[:20]) if s not in (0, 1, 3, 5, 9, 13))
    # from step 20: periods of 1 round for 3 rounds, then 2, then 4 (clipped), each ending in a sync
    assert [s for s, k in enumerate(kinds) if k == SYNC] == [20, 21, 22, 24, 26, 30, 34, 38]
    assert all(k == LOCAL for s, k in enumerate(kinds[20:], start=20) if s not in (20, 21, 22, 24, 26, 30, 34, 38))
    assert phase.warmup == 2 and phase.local_steps
    assert [phase.kind(s) for s in range(40)] == kinds  # asking again (or out of order) gives the same rounds


def test_the_bound_keeps_a_quiet_coordinate_from_setting_its_chunks_scale():
    """A coordinate whose v was ~0 at the freeze (an unseen token's embedding) then gets a gradient: unclipped, its
    m / d (1e7) becomes the chunk's scale and every other coordinate of the chunk moves by 1e7 / chunk."""
    denominators = torch.ones(64)
    denominators[0] = 1e-8
    gradients = torch.full((64,), 0.01)
    gradients[0] = 1.0
    sizes = {}
    for bound in (0.0, 1.0):
        hooks = OneBitMomentum(chunk_size=64, freeze_step=1, bound=bound)
        hooks.phase.steps, hooks.phase.optimizer = 1, types.SimpleNamespace(beta1=0.9)
        hooks.denominators["u/0"] = denominators
        sizes[bound] = hooks.decompress(hooks.compress(gradients, "u/0", seed=0)).abs().max()
    assert sizes[0.0] > 1e4 and sizes[1.0] <= 1.0


def _owner_steps(rank: int, world: int) -> dict:
    """FULL_SHARD's reduce-scatter hook and 0/1 Adam on one shard, gradients that do not depend on the weights:
    an exact round, then syncs at steps 1, 3 and 7 with local rounds between (lossless code: a scale per value)."""
    phase = ZeroOnePhase(var_freeze_step=1, var_update_scaler=1, local_step_scaler=1, local_step_clipper=4)
    compressor = OneBitMomentum(chunk_size=1, bound=0.0, phase=phase)
    param = torch.nn.Parameter(torch.zeros(SHARD))
    optimizer = OneBitAdam([param], phase, lr=0.1, betas=(0.9, 0.95), weight_decay=0.0)
    layout = types.SimpleNamespace(shard_numel=SHARD, places=[types.SimpleNamespace(param=param)],
                                   local_views=lambda flat: [flat])
    stats = CommStats()
    hook = OneBitAdamReduceScatter(compressor, stats, "unit0", layout)
    trajectory = []
    for step in range(8):
        rows = gradient(rank + 10 * step, world * SHARD) / 10 + 2  # denominators near 2, not near 0
        out = torch.empty(SHARD)
        kind = phase.round
        hook(output_tensor=out, input_tensor=rows, group=dist.group.WORLD, op=dist.ReduceOp.AVG)
        param.grad = out
        optimizer.step()
        trajectory.append((kind, param.detach().clone(), stats.take()["bytes_sent"], optimizer.denominator(param)))
    return {"trajectory": trajectory}


def test_local_rounds_apply_the_owners_momentum_and_a_sync_replaces_them_by_the_average(tmp_path):
    per_rank = run(_owner_steps, tmp_path)
    beta1, lr = 0.9, 0.1
    for rank, result in enumerate(per_rank):
        kinds = [kind for kind, *_ in result["trajectory"]]
        assert kinds == [EXACT, SYNC, LOCAL, SYNC, LOCAL, LOCAL, LOCAL, SYNC]
        rows = [[gradient(r + 10 * step, 2 * SHARD).view(2, SHARD)[rank] / 10 + 2 for r in range(2)] for step in range(8)]
        d = result["trajectory"][1][3]  # the frozen denominators (the exact round's variance)
        sent_d = d.bfloat16().float()  # as the hooks received them: 0/1 Adam gathers them in bfloat16
        weights = result["trajectory"][0][1].clone()
        carried = (1 - beta1) * (rows[0][0] + rows[0][1]) / 2  # AdamW's momentum after the exact round
        local = [torch.zeros(SHARD), torch.zeros(SHARD)]
        at_sync = weights.clone()  # the synchronised trajectory: every rank's momenta averaged every round
        for step in range(1, 8):
            local = [beta1 * m + (1 - beta1) * g for m, g in zip(local, rows[step])]
            carried = carried * beta1
            step_size = lr / (1 - beta1 ** (step + 1))
            at_sync = at_sync - step_size * (carried / d + (local[0] + local[1]) / 2 / sent_d)
            weights = weights - step_size * (carried / d + local[rank] / sent_d)  # a local round: the owner's own
            kind, applied, sent, _ = result["trajectory"][step]
            if kind == SYNC:
                torch.testing.assert_close(applied, at_sync, rtol=1e-5, atol=1e-6)
                weights = at_sync.clone()
                gathered = 2 * SHARD if step == 1 else 0  # the denominators, once after the exact round
                assert sent == gathered + SHARD * 4 + -(-SHARD // 8)  # the other rank's row: signs and a scale each
            else:
                torch.testing.assert_close(applied, weights, rtol=1e-5, atol=1e-6)
                assert sent == 0


def test_exact_rounds_take_the_delivered_momentum_folded_in_at_once_and_count_their_own_variance_updates():
    phase = ZeroOnePhase(var_freeze_step=10, var_update_scaler=2, local_step_scaler=1, local_step_clipper=1)
    param = torch.nn.Parameter(torch.zeros(8))
    optimizer = OneBitAdam([param], phase, lr=0.1, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(0)
    for step in range(4):  # exact, exact, onebit, exact
        grad = torch.randn(8, generator=generator)
        kind = phase.round
        if kind == ONEBIT:  # the carried momentum, decayed, and the delivered one, for the exact round next
            expected = 0.9 * optimizer.state[param]["exp_avg"] + grad * 0.5 * optimizer.denominator(param)
        param.grad = grad if kind == EXACT else grad * 0.5  # an onebit round's grad is a delivered momentum / d
        optimizer.step()
        if kind == ONEBIT:  # at once, in AdamW's own state: a key of its own would not come back from a checkpoint
            torch.testing.assert_close(optimizer.state[param]["exp_avg"], expected)
            assert set(optimizer.state[param]) == {"step", "exp_avg", "exp_avg_sq"}
    assert [phase.kind(s) for s in range(4)] == [EXACT, EXACT, ONEBIT, EXACT]
    torch.testing.assert_close(optimizer.state[param]["exp_avg"], 0.9 * expected + 0.1 * grad)
    assert phase.variance_updates == 3 and int(optimizer.state[param]["step"]) == 4


@pytest.mark.parametrize("settings, message", [
    ({"local_step_clipper": 0}, "local_step_clipper=0 is not an integer >= 1"),
    ({"var_update_scaler": 1.5}, "var_update_scaler=1.5 is not an integer >= 1"),
    ({"bound": -1}, "bound=-1 is not a number >= 0"),
    ({"freeze_step": 3}, "does not apply to method 'zero_one_adam'"),
])
def test_bad_settings_raise_one_clear_error(settings, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig(method="zero_one_adam", **settings).build(rank=0)


def test_memory_adds_the_periods_accumulator_and_replicas_refuse_local_rounds():
    assert CompressionConfig(method="zero_one_adam").state_bytes(1000, shard=4, replicas=1, rows=64) == 16000
    synced = CompressionConfig(method="zero_one_adam", local_step_clipper=1)
    assert synced.state_bytes(1000, shard=4, replicas=1, rows=64) == 12000
    synced.check_replicas(2)  # every round syncs: replicas are fine
    with pytest.raises(ValueError, match="local rounds need one owner per shard.*set local_step_clipper: 1"):
        CompressionConfig(method="zero_one_adam").check_replicas(2)
    assert CompressionConfig(method="zero_one_adam").warmup() == 1  # round 0; rounds 1, 3, 7, ... are exact too


# --- through the CLI ---------------------------------------------------------------------------------------------

def test_the_first_rounds_reproduce_fsdp2s_own_reduce_scatter_bit_for_bit(tmp_path):
    plain = fit(tmp_path / "plain", steps=4)
    zero_one = fit(tmp_path / "zero_one", KNOB, "{method: zero_one_adam, var_update_scaler: 3}", steps=4)
    assert zero_one["train/loss"] == plain["train/loss"]  # 3 AdamW rounds, then the loss they lead to

