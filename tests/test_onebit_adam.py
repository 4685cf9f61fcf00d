"""1-bit Adam on FSDP2: the optimizer's two phases, the hooks' local momenta, 1 and 2 processes.

Real runs of the CLI are in tests/test_onebit_adam_runs.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from compress.communicator import CommStats, CompressedReduceScatter
from compress.config import CompressionConfig
from compress.onebit_adam import OneBitAdam
from compress.onebit_momentum import OneBitMomentum
from tests.distributed import run
from tests.helpers import SHARD, batch, gradient, loss_of, optimizer_for, sharded_model

BETAS = (0.9, 0.95)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((16, 8), (8,))]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]


def _gradients(steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in ((16, 8), (8,))] for _ in range(steps)]


def _set(params: list[torch.nn.Parameter], gradients: list[torch.Tensor]) -> None:
    for param, values in zip(params, gradients):
        param.grad = values.clone()


def _frozen(hooks: OneBitMomentum, denominators: dict[str, torch.Tensor], beta1: float = 0.9) -> OneBitMomentum:
    """``hooks`` past the freeze, as if an optimizer with ``beta1`` had been built and had gathered ``denominators``."""
    hooks.phase.steps, hooks.phase.optimizer = hooks.phase.freeze_step, types.SimpleNamespace(beta1=beta1)
    hooks.denominators.update(denominators)
    return hooks


def test_the_warm_up_is_adamw_exactly():
    reference, ours = _params(), _params()
    adamw = torch.optim.AdamW(_groups(reference), lr=1e-2, betas=BETAS)
    onebit = OneBitAdam(_groups(ours), OneBitMomentum(freeze_step=5).phase, lr=1e-2, betas=BETAS)
    for gradients in _gradients(5):
        for params, optimizer in ((reference, adamw), (ours, onebit)):
            _set(params, gradients)
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(reference, ours))
    assert onebit.phase.frozen and onebit.phase.steps == 5 and onebit.steps_in_state() == 5


def test_after_the_freeze_the_step_is_the_carried_plus_delivered_momentum_over_the_frozen_variance():
    freeze, lr, eps = 3, 1e-2, 1e-8
    params = _params()
    hooks = OneBitMomentum(freeze_step=freeze)
    optimizer = OneBitAdam(_groups(params), hooks.phase, lr=lr, betas=BETAS, eps=eps)
    gradients = _gradients(8)
    for step_gradients in gradients[:freeze]:
        _set(params, step_gradients)
        optimizer.step()
    weights = [p.detach().clone() for p in params]
    momentum = [optimizer.state[p]["exp_avg"].clone() for p in params]  # AdamW's at the freeze
    variance = [optimizer.state[p]["exp_avg_sq"].clone() for p in params]
    local = [torch.zeros_like(p) for p in params]  # the hooks' local momenta start at zero at the freeze
    beta1, beta2 = BETAS
    denominators = [(v / (1 - beta2 ** freeze)).sqrt() + eps for v in variance]
    assert all(torch.equal(optimizer.denominator(p), d) for p, d in zip(params, denominators))
    for step, step_gradients in enumerate(gradients[freeze:], start=freeze + 1):
        local = [beta1 * m + (1 - beta1) * g for m, g in zip(local, step_gradients)]
        _set(params, [m / d for m, d in zip(local, denominators)])  # what lossless hooks deliver: avg(m / d)
        assert not optimizer.clipping_applies
        optimizer.step()
        momentum = [beta1 * m + (1 - beta1) * g for m, g in zip(momentum, step_gradients)]  # Adam's, on the true gradients
        for index, (w, m, v) in enumerate(zip(weights, momentum, variance)):
            decay = 0.1 if index == 0 else 0.0
            w.mul_(1 - lr * decay)
            w.sub_(lr * (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** freeze)).sqrt() + eps))
    for param, expected in zip(params, weights):
        torch.testing.assert_close(param.detach(), expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(optimizer.state[params[0]]["exp_avg_sq"], variance[0])  # frozen


def test_error_feedback_makes_the_applied_momentum_converge_to_the_true_average():
    """Two ranks' hooks: the sum over steps of what the owner applies tracks the sum of the true averaged momenta."""
    ranks = [_frozen(OneBitMomentum(chunk_size=64, freeze_step=1, bound=0), {"unit0/0": torch.ones(1000)}) for _ in range(2)]
    generator = torch.Generator().manual_seed(0)
    drift = torch.randn(1000, generator=generator)
    applied_sum = true_sum = torch.zeros(1000)
    step_errors, gaps = [], {}
    for step in range(1, 201):
        gradients = [drift + 3 * torch.randn(1000, generator=generator) for _ in ranks]
        payloads = [hooks.compress(g, "unit0/0", seed=step) for hooks, g in zip(ranks, gradients)]
        applied = sum(ranks[0].decompress(p) for p in payloads) / 2
        true = sum(hooks.momenta["unit0/0"] for hooks in ranks) / 2
        step_errors.append(float((applied - true).norm() / true.norm()))
        applied_sum, true_sum = applied_sum + applied, true_sum + true
        if step in (50, 200):
            gaps[step] = float((applied_sum - true_sum).norm() / true_sum.norm())
    owed = sum(hooks.inner.residuals["unit0/0"] for hooks in ranks) / 2
    torch.testing.assert_close(true_sum - applied_sum, owed, rtol=1e-4, atol=1e-3)  # exactly what is still owed
    assert min(step_errors) > 0.2  # one step's signs are far from the momentum...
    assert gaps[200] < 0.05 and gaps[200] < gaps[50] / 2  # ...their sums converge: the gap stays bounded


def test_the_hooks_state_round_trips_and_the_second_stage_shares_it_without_accumulating():
    hooks = _frozen(OneBitMomentum(chunk_size=8, freeze_step=1, state_dtype=torch.bfloat16),
                    {"unit0/0": torch.full((16,), 2.0, dtype=torch.bfloat16)})
    hooks.compress(torch.ones(16), "unit0/0", seed=0)
    second = hooks.second_stage()
    second.compress(torch.ones(4), "unit0/ar", seed=0)
    assert set(hooks.momenta) == {"unit0/0"} and set(hooks.inner.residuals) == {"unit0/0", "unit0/ar"}
    assert second.compressing and hooks.momenta["unit0/0"].dtype == torch.bfloat16
    restored = OneBitMomentum(chunk_size=8, freeze_step=1, state_dtype=torch.bfloat16)
    restored.load_state_dict(hooks.state_dict())
    assert torch.equal(restored.momenta["unit0/0"], hooks.momenta["unit0/0"])
    assert hooks.memory_bytes == 2 * (16 + 16 + 4 + 16)  # momenta, residuals, denominators, in bfloat16
    assert restored.memory_bytes == 2 * (16 + 16 + 4) and not restored.denominators  # gathered again when used


def test_the_optimizer_restores_its_phase_from_its_state():
    params = _params()
    optimizer = OneBitAdam(_groups(params), OneBitMomentum(freeze_step=2).phase, lr=1e-2, betas=BETAS)
    for gradients in _gradients(3):
        _set(params, gradients)
        optimizer.step()
    resumed = OneBitAdam(_groups(params), OneBitMomentum(freeze_step=2).phase, lr=1e-2, betas=BETAS)
    assert not resumed.phase.frozen
    resumed.load_state_dict(optimizer.state_dict())
    assert resumed.phase.steps == 3 and resumed.phase.frozen


@pytest.mark.parametrize("settings, message", [
    ({"error_feedback": True}, "built with its own error feedback"),
    ({"freeze_step": 0}, "freeze_step=0 is not an integer >= 1"),
    ({"threshold": 0.1}, "does not apply to method 'onebit_adam'"),
])
def test_bad_settings_raise_one_clear_error(settings, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig(method="onebit_adam", **settings).build(rank=0)


def test_memory_counts_local_momenta_residuals_and_denominators_unsharded():
    fp32, bf16 = CompressionConfig(method="onebit_adam"), CompressionConfig(method="onebit_adam", residual_dtype="bfloat16")
    assert fp32.state_bytes(1000, shard=4, replicas=1, rows=64) == 12000  # a momentum, residual and denominator each
    assert bf16.state_bytes(1000, shard=4, replicas=1, rows=64) == 6000
    assert fp32.state_bytes(1000, shard=1, replicas=4, rows=64) == 12000  # NO_SHARD: the all-reduce holds them
    assert fp32.state_bytes(1000, shard=2, replicas=2, rows=64) == 12000 + 4 * 500  # HYBRID: a residual per shard
    assert fp32.warmup() == 100 and CompressionConfig(method="int8").warmup() == 0


def _lossless_losses(rank: int, world: int, steps: int, freeze: int) -> list[float]:
    """FULL_SHARD on ``world`` ranks, every rank on the same batches, 1-bit Adam with one scale per element
    (signs times |x|: lossless), so 1 and 2 ranks must agree through the compressed phase."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    compression = CompressionConfig(method="onebit_adam", freeze_step=freeze, chunk_size=1)
    module, strategy = sharded_model(rank, world, mesh, "FULL_SHARD", compression)
    optimizer = optimizer_for(module, strategy)
    data = torch.Generator().manual_seed(7)  # the same on every rank
    losses = []
    for _ in range(steps):
        loss = loss_of(module, *batch(data, module.model.config.vocab_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses + [strategy.comm_hook.stats.take()["bytes_sent"]]


def test_one_and_two_processes_agree_through_the_freeze_when_the_codec_is_lossless(tmp_path):
    for folder in ("one", "two"):
        (tmp_path / folder).mkdir()
    (one,) = run(_lossless_losses, tmp_path / "one", 8, 3, world=1)
    two = run(_lossless_losses, tmp_path / "two", 8, 3, world=2)
    assert two[0] == two[1]
    assert two[0][-1] > 0  # compressed payloads went over the wire
    assert one[:-1] == pytest.approx(two[0][:-1], rel=1e-5)


def _skipped_nonfinite_step(rank: int, world: int) -> dict:
    """2 ranks, frozen from step 2; rank 1's loss is NaN at step 4: the guard skips the step everywhere."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    module, strategy = sharded_model(rank, world, mesh, "FULL_SHARD", CompressionConfig(method="onebit_adam", freeze_step=2))
    strategy.on_nonfinite = "skip_step"
    module._trainer = types.SimpleNamespace(global_step=0)  # what the guard's message reads
    optimizer = optimizer_for(module, strategy)
    data = torch.Generator().manual_seed(1000 + rank)
    before = after = None
    for step in range(1, 7):
        loss = loss_of(module, *batch(data, module.model.config.vocab_size))
        if step == 4 and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        if step == 4:
            before = [p.to_local().detach().clone() for p in module.model.parameters()]
        strategy.clip_and_guard(optimizer, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step == 4:
            after = [p.to_local().detach().clone() for p in module.model.parameters()]
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in module.model.parameters())
    return {"unchanged": all(torch.equal(a, b) for a, b in zip(before, after)), "finite": finite,
            "steps": optimizer.phase.steps, "skipped": strategy.nonfinite_steps}


def test_a_nonfinite_step_after_the_freeze_is_skipped_on_every_rank_and_training_goes_on(tmp_path):
    for result in run(_skipped_nonfinite_step, tmp_path):
        assert result == {"unchanged": True, "finite": True, "steps": 5, "skipped": 1}


def _hook_calls(rank: int, world: int) -> list:
    """The reduce-scatter hook called as FSDP2 calls it, once before the freeze and twice after."""
    compressor = CompressionConfig(method="onebit_adam", freeze_step=1).build(rank)
    compressor.phase.optimizer = types.SimpleNamespace(beta1=0.9)
    for row in range(world):  # what the freeze would have gathered
        compressor.denominators[f"unit0/{row}"] = torch.full((SHARD,), 0.5)
    stats = CommStats()
    hook = CompressedReduceScatter(compressor, stats, "unit0")
    calls = []
    for step in range(3):
        compressor.phase.steps = step
        out = torch.empty(SHARD)
        hook(output_tensor=out, input_tensor=gradient(rank + 10 * step, world * SHARD), group=dist.group.WORLD,
             op=dist.ReduceOp.AVG)
        calls.append((out, stats.take()))
    return calls


def test_the_hook_reduces_exactly_before_the_freeze_and_averages_decoded_momenta_after(tmp_path):
    per_rank = run(_hook_calls, tmp_path)
    for rank, calls in enumerate(per_rank):
        rows = [[gradient(r + 10 * step, 2 * SHARD).view(2, SHARD)[rank] for r in range(2)] for step in range(3)]
        (warm, warm_stats), *frozen = calls
        torch.testing.assert_close(warm, (rows[0][0] + rows[0][1]) / 2, rtol=0, atol=0)
        assert warm_stats["bytes_sent"] == warm_stats["bytes_raw"] == SHARD * 4
        # after the freeze: every rank's local momentum for this row, compressed as that rank's hooks did
        senders = [_frozen(OneBitMomentum(freeze_step=1), {f"unit0/{rank}": torch.full((SHARD,), 0.5)}) for _ in range(2)]
        for step, (out, step_stats) in enumerate(frozen, start=1):
            decoded = [s.decompress(s.compress(rows[step][r], f"unit0/{rank}", 0)) for r, s in enumerate(senders)]
            torch.testing.assert_close(out, (decoded[0] + decoded[1]) / 2, rtol=1e-6, atol=1e-6)
            assert step_stats["bytes_sent"] == -(-SHARD // 8) + 4 * -(-SHARD // 128)  # sign bits, a scale per 128
