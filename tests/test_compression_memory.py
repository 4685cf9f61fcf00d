"""The memory compression state takes (error-feedback residuals, DGC velocities, PowerSGD's and Sketched-SGD's state):
its one per-method figure, the tuner's estimate and the preflight refusal built on it, and bfloat16 residuals.

Nothing is allocated at 8B: the shapes come from the llama-8b preset built on the meta device.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from compress.config import CompressionConfig
from compress.dgc import DeepGradientCompression
from compress.error_feedback import ErrorFeedback
from lit_fsdp.presets import build_config
from lit_fsdp.strategy import FSDP2Strategy, check_device_memory
from lit_fsdp.commands.tune.memory import ModelShape, estimate
from lit_fsdp.commands.tune.space import Candidate, RunShape

GIB = 2**30
LLAMA_8B = ModelShape.of(build_config("llama-8b"))  # 8,030,261,248 parameters, hidden 4096
TOPK_EF = {"method": "topk", "ratio": 0.1, "error_feedback": True}
DGC = {"method": "topk", "ratio": 0.01, "error_feedback": True, "momentum": 0.9}


@pytest.mark.parametrize("settings, per_param", [
    ({"method": "none"}, 0), ({"method": "int8"}, 0), ({"method": "qsgd"}, 0), ({"method": "topk"}, 0),
    ({"method": "int8", "error_feedback": True}, 4), (TOPK_EF, 4), ({**TOPK_EF, "residual_dtype": "bfloat16"}, 2),
    ({**DGC, "clip_norm": 1.0, "momentum": 0.0}, 4), (DGC, 8), ({**DGC, "residual_dtype": "bfloat16"}, 4),
    ({"method": "sketch"}, 4), ({"method": "powersgd", "rank": 4}, 4 + 4 * 4 / 4096),
])
def test_state_bytes_per_parameter_of_each_method(settings, per_param):
    assert CompressionConfig(**settings).state_bytes_per_param(rows=4096) == pytest.approx(per_param)


@pytest.mark.parametrize("replicas, shard, elements", [
    (1, 8, 1.0),  # FULL_SHARD: the reduce-scatter compresses the whole unsharded gradient on every rank
    (8, 1, 1.0),  # NO_SHARD: the replicate all-reduce compresses the whole gradient
    (2, 4, 1.25),  # HYBRID_SHARD: both, the all-reduce over this rank's quarter
    (1, 1, 0.0),  # one process: no hook
])
def test_state_is_per_rank_a_whole_model_whatever_the_sharding(replicas, shard, elements):
    assert CompressionConfig(**TOPK_EF).state_bytes(1000, shard, replicas, rows=64) == 4 * 1000 * elements


def test_the_tuners_estimate_counts_the_configs_error_feedback_residuals():
    run = RunShape(world_size=8, nodes=1, accelerator="cuda", seq_len=2048, batch_per_process=1, clipping=False)
    plain = estimate(Candidate(compression="topk"), LLAMA_8B, run)  # a method at its defaults: no error feedback
    with_ef = estimate(Candidate(compression="topk"), LLAMA_8B, run, base_compression=TOPK_EF)
    halved = estimate(Candidate(compression="topk"), LLAMA_8B, run, base_compression={**TOPK_EF, "residual_dtype": "bfloat16"})
    assert plain.compression == 0
    assert with_ef.compression == 4 * LLAMA_8B.parameters  # 29.9 GiB per GPU
    assert halved.compression == 2 * LLAMA_8B.parameters
    assert with_ef.device_total - plain.device_total == with_ef.compression
    assert with_ef.parts_gb()["compression"] == pytest.approx(29.915, abs=1e-3)


def test_preflight_check_refuses_fp32_residuals_that_cannot_fit_beside_the_model_states():
    # llama-8b on 8 x 40 GiB, FULL_SHARD: 15.0 GiB of model states + 29.9 GiB of residuals
    with pytest.raises(ValueError, match=r"error-feedback residuals need 29\.9 GiB per GPU .* 8\.0B parameters.*"
                                         r"compression\.residual_dtype bfloat16 \(halves them\)") as refused:
        check_device_memory(LLAMA_8B.parameters, LLAMA_8B.hidden, (8,), False, CompressionConfig(**TOPK_EF), 40 * GIB)
    assert "\n" not in str(refused.value)
    bf16 = CompressionConfig(**TOPK_EF, residual_dtype="bfloat16")
    check_device_memory(LLAMA_8B.parameters, LLAMA_8B.hidden, (8,), False, bf16, 40 * GIB)  # 15.0 + 15.0 fit
    check_device_memory(LLAMA_8B.parameters, LLAMA_8B.hidden, (8,), False, CompressionConfig(**TOPK_EF), 80 * GIB)
    check_device_memory(LLAMA_8B.parameters, LLAMA_8B.hidden, (8,), False, CompressionConfig(method="int8"), 40 * GIB)


@pytest.mark.parametrize("settings, what", [
    (DGC, "error-feedback residuals and DGC velocities need 59.8 GiB"),
    ({"method": "powersgd"}, "PowerSGD's residuals and warm-start Qs need 29.9 GiB"),
    ({"method": "sketch"}, "Sketched-SGD's residuals need 29.9 GiB"),
])
def test_preflight_check_names_the_state_of_each_method(settings, what):
    with pytest.raises(ValueError, match=what):
        check_device_memory(LLAMA_8B.parameters, LLAMA_8B.hidden, (8,), False, CompressionConfig(**settings), 40 * GIB)


def test_preflight_check_names_sharding_or_offload_when_the_model_states_alone_do_not_fit():
    with pytest.raises(ValueError, match=r"model states need 119\.7 GiB .*cpu_offload true"):
        check_device_memory(LLAMA_8B.parameters, LLAMA_8B.hidden, (1,), False, None, 80 * GIB)


def test_fsdp2_preflight_runs_the_check_on_a_gpu_before_launch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=40 * GIB))
    strategy = FSDP2Strategy(compression=CompressionConfig(**TOPK_EF))
    strategy.parallel_devices = [torch.device("cuda", 0)]
    module = SimpleNamespace(hf_config=lambda: build_config("llama-8b"))
    with pytest.raises(ValueError, match="residual_dtype bfloat16"):
        strategy.preflight(SimpleNamespace(num_nodes=1, num_devices=8), module)


@pytest.mark.parametrize("settings, message", [
    ({**TOPK_EF, "residual_dtype": "float16"}, "residual_dtype 'float16' is not one of float32, bfloat16"),
    ({"method": "topk", "residual_dtype": "bfloat16"}, "error_feedback is false"),
    ({"method": "powersgd", "residual_dtype": "bfloat16"}, "'powersgd' keeps its built-in residuals in float32"),
])
def test_residual_dtype_is_validated(settings, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig(**settings).build(rank=0)


def test_bfloat16_residuals_and_velocities_take_half_the_memory():
    gradient = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    memory = {}
    for dtype in ("float32", "bfloat16"):
        for name, settings in (("ef", TOPK_EF), ("dgc", DGC)):
            compressor = CompressionConfig(**settings, residual_dtype=dtype).build(rank=0)
            assert isinstance(compressor, DeepGradientCompression if name == "dgc" else ErrorFeedback)
            compressor.compress(gradient, "unit0/0", seed=0)
            compressor.compress(gradient, "unit0/0", seed=1)
            assert {r.dtype for r in compressor.residuals.values()} == {getattr(torch, dtype)}
            memory[name, dtype] = compressor.memory_bytes
    assert memory["ef", "float32"] == 4 * 10_000 and memory["ef", "bfloat16"] == 2 * 10_000
    assert memory["dgc", "float32"] == 8 * 10_000 and memory["dgc", "bfloat16"] == 4 * 10_000


def test_bfloat16_residuals_still_send_the_sum_of_the_inputs():
    """Error feedback's invariant, sum of inputs = sum sent + last residual, holds with bfloat16 residuals up to
    their rounding: elementwise at most 2**-8 of each step's residual (round to nearest, 8 significant bits)."""
    generator = torch.Generator().manual_seed(0)
    n, steps = 4096, 200
    drift = torch.randn(n, generator=generator)  # a consistent direction under per-step noise, as gradients have
    inputs = [drift + 3 * torch.randn(n, generator=generator) for _ in range(steps)]
    total_in = torch.stack(inputs).sum(0)
    gaps = {}
    for dtype in ("float32", "bfloat16"):
        compressor = CompressionConfig(**TOPK_EF, residual_dtype=dtype).build(rank=0)
        sent, rounding = torch.zeros(n), torch.zeros(n)
        for step, x in enumerate(inputs):
            before = compressor.residuals.get("k")
            corrected = x if before is None else x + before.float()
            decoded = compressor.decompress(compressor.compress(x, "k", seed=step))
            sent += decoded
            rounding += (corrected - decoded).abs()  # the float32 residual before it is stored
        residual = compressor.residuals["k"].float()
        slack = 1e-5 * torch.stack(inputs).abs().sum(0)  # float32's own summation error
        bound = (2**-8 * rounding if dtype == "bfloat16" else 0) + slack
        assert ((total_in - sent - residual).abs() <= bound).all()
        gaps[dtype] = float((total_in - sent).norm() / total_in.norm())
    # what is still owed after 200 steps is a few percent of what was sent, and bf16 storage adds little to it
    assert gaps["float32"] < 0.05 and gaps["bfloat16"] < 0.05
    assert gaps["bfloat16"] < 1.1 * gaps["float32"]
