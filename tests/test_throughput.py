"""MFU: the analytic FLOP count against torch's FLOP counter, the GPU peak table, and MFU in a real run."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from callbacks import throughput
from callbacks.throughput import Throughput
from lit_fsdp.device_peaks import peak_tflops
from lit_fsdp.lora import adapter_parameters
from lit_fsdp.flops import flops_per_token, matmul_shape, recompute_flops_per_token
from lit_fsdp.parallelize import apply_activation_checkpointing, find_blocks
from lit_fsdp.presets import build_config
from tests.helpers import fit

SEQ_LEN = 64
CONFIGS = {
    "gpt2-tiny": build_config("gpt2-tiny"),
    "llama-tiny": build_config("llama-tiny"),  # grouped-query attention, tied head
    # Untied head, and attention wider than the residual stream (4 heads x 32 > 64).
    "llama-tiny-untied-wide": build_config("llama-tiny", {"tie_word_embeddings": False, "head_dim": 32}),
}


def counted_flops_per_token(config, checkpoint_every: int = 0) -> float:
    """FlopCounterMode's count for one forward + backward of the HF model on CPU, per token."""
    # Eager attention: CPU's fused SDPA kernel has no FLOP formula and would count as 0.
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.config.use_cache = False  # as CausalLM sets it: a cache would grow again in the recompute
    if checkpoint_every:
        apply_activation_checkpointing(model, find_blocks(model), checkpoint_every)
    tokens = torch.randint(0, config.vocab_size, (2, SEQ_LEN + 1))
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=tokens[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return counter.get_total_flops() / tokens[:, :-1].numel()


@pytest.mark.parametrize("name", CONFIGS)
def test_flops_per_token_matches_torch_flop_counter_on_forward_and_backward(name):
    # The counter sees every matmul (linear, bmm); what the analytic count leaves out (norms, softmax,
    # biases, the embedding lookup) it does not count either, so the two agree exactly today; the
    # slack covers small matmuls a model version might add (e.g. rotary frequency tables).
    config = CONFIGS[name]
    assert flops_per_token(config, SEQ_LEN) == pytest.approx(counted_flops_per_token(config), rel=1e-3)


def test_gpt2_tiny_flops_per_token_by_hand():
    # 2 layers x (4 x 64^2 attention + 2 x 64 x 256 MLP) + the 512 x 64 head, times 6; plus 12 x 2 x 64 x 128.
    assert flops_per_token(CONFIGS["gpt2-tiny"], 128) == 6 * (2 * 12 * 64**2 + 512 * 64) + 12 * 2 * 64 * 128 == 983_040


@pytest.mark.parametrize("name, every", [("gpt2-tiny", 1), ("llama-tiny", 1), ("llama-tiny", 2)])
def test_recompute_flops_equal_what_checkpointing_runs_again(name, every):
    config = CONFIGS[name]
    extra = counted_flops_per_token(config, checkpoint_every=every) - counted_flops_per_token(config)
    assert recompute_flops_per_token(config, SEQ_LEN, every) == pytest.approx(extra, rel=1e-3)
    assert recompute_flops_per_token(config, SEQ_LEN, 0) == 0


@pytest.mark.parametrize(
    "device_name, bf16, fp8",
    [
        ("NVIDIA H100 80GB HBM3", 989.5, 1979.0),
        ("NVIDIA H100 PCIe", 756.5, 1513.0),
        ("NVIDIA H100 NVL", 835.5, 1670.5),
        ("NVIDIA H200", 989.5, 1979.0),
        ("NVIDIA H200 NVL", 835.5, 1670.5),
        ("NVIDIA GH200 480GB", 989.5, 1979.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, None),
        ("NVIDIA A100-PCIE-40GB", 312.0, None),
        ("NVIDIA GeForce RTX 4090", None, None),
        ("cpu", None, None),
    ],
)
def test_peak_lookup_by_device_name(device_name, bf16, fp8):
    assert peak_tflops(device_name, torch.bfloat16) == bf16
    assert peak_tflops(device_name, torch.float16) == bf16
    assert peak_tflops(device_name, torch.float8_e4m3fn) == fp8


def test_float32_peak_follows_the_matmul_precision():
    assert torch.get_float32_matmul_precision() == "highest"  # torch's default: IEEE fp32 on CUDA cores
    assert peak_tflops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5
    torch.set_float32_matmul_precision("high")
    try:
        assert peak_tflops("NVIDIA A100-SXM4-80GB", torch.float32) == 156.0
        assert peak_tflops("NVIDIA H100 80GB HBM3", torch.float32) == 494.5
    finally:
        torch.set_float32_matmul_precision("highest")


def timed(callback: Throughput, config, world_size: int = 2, checkpoint_every: int = 0) -> dict:
    """The summary of 2 one-second steps of 4 sequences x 128 tokens on each of ``world_size`` ranks."""
    callback.model_config, callback.seq_len, callback.world_size = config, 128, world_size
    callback.recompute_flops = lambda config, seq_len: recompute_flops_per_token(config, seq_len, checkpoint_every)
    callback.step_seconds = [1.0, 1.0]
    callback.tokens_per_step, callback.samples_per_step = 4 * 128 * world_size, 4 * world_size
    return callback.summary()


def test_mfu_is_model_flops_per_device_over_the_given_peak():
    summary = timed(Throughput(warmup_steps=0, peak_tflops=0.1), CONFIGS["gpt2-tiny"])
    assert summary["samples_per_s"] == 8 and summary["tokens_per_s"] == 1024
    assert summary["flops_per_token"] == 983_040
    assert summary["mfu"] == pytest.approx(983_040 * 512 / 0.1e12)  # 512 tokens/s on each of 2 devices
    assert summary["hfu"] == summary["mfu"]  # nothing recomputed
    checkpointed = timed(Throughput(warmup_steps=0, peak_tflops=0.1), CONFIGS["gpt2-tiny"], checkpoint_every=1)
    assert checkpointed["mfu"] == summary["mfu"] < checkpointed["hfu"]


def test_hfu_counts_the_recompute_the_strategy_reports_slide_fsdps_whole_blocks_of_its_plan():
    """A strategy that lists its recomputed blocks (SlideFSDP's activation plan) and runs their whole forward again:
    HFU adds those blocks' forward, the last matmul included; torch's checkpointing of the same blocks stops before it."""
    from lit_fsdp.reporting import StrategyReport

    class Planned(StrategyReport):
        label, recomputed_blocks, recomputes_whole_block = "slide_fsdp", (0,), True

        def compute_dtype(self):
            return torch.float32

    config = CONFIGS["gpt2-tiny"]
    shape = matmul_shape(config)
    whole = Planned().recompute_flops(config, 128)
    assert whole == 2 * shape.block_weights + 4 * shape.attention_width * 128  # block 0's forward, once per token
    assert whole - recompute_flops_per_token(config, 128, [0]) == 2 * shape.last_weights
    assert recompute_flops_per_token(config, 128, [0, 1]) == recompute_flops_per_token(config, 128, 1)


def test_a_lora_run_counts_no_weight_gradients_for_its_frozen_base():
    """A frozen matrix costs 4 FLOPs per weight and token (forward, input gradient), a trained adapter weight 6."""
    config = CONFIGS["gpt2-tiny"]
    full = timed(Throughput(warmup_steps=0, peak_tflops=0.1), config)
    callback = Throughput(warmup_steps=0, peak_tflops=0.1)
    callback.lora = {"rank": 4, "alpha": 8}
    lora = timed(callback, config)
    shape = matmul_shape(config)
    weights = shape.layers * shape.block_weights + shape.head_weights
    adapters = adapter_parameters(config, callback.lora)
    assert adapters > 0 and full["flops_per_token"] - lora["flops_per_token"] == 2 * weights - 6 * adapters
    assert lora["mfu"] < full["mfu"]


def test_mfu_is_null_with_one_info_line_and_no_warning_when_the_peak_is_unknown(monkeypatch):
    callback = Throughput(warmup_steps=0)
    config = CONFIGS["gpt2-tiny"]
    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(), precision="32-true")
    module = SimpleNamespace(model=SimpleNamespace(config=config), device=torch.device("cpu"), hparams={})
    said = []
    monkeypatch.setattr(throughput, "rank_zero_info", said.append)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # expected on a CPU: information, not a warning
        callback.on_train_start(trainer, module)
    assert len(said) == 1
    assert said[0].startswith("Throughput: MFU is null: no peak for 'cpu' in fp32; give one device's peak TFLOPS with "
                              "--peak_tflops on fit's command line")
    summary = timed(callback, config)
    assert summary["mfu"] is None and summary["peak_tflops"] is None
    assert summary["flops_per_token"] == 983_040


def test_peak_tflops_must_be_positive():
    with pytest.raises(ValueError, match="peak_tflops=0"):
        Throughput(peak_tflops=0)


def test_running_tokens_per_s_goes_to_the_progress_bar_over_the_last_steps(monkeypatch):
    callback = Throughput(warmup_steps=0)
    clock = iter([0.0, 1.0, 3.0] + [3.0 + 0.5 * i for i in range(1, 13)])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    logged = []
    module = SimpleNamespace(device=torch.device("cpu"), log=lambda key, value, **kw: logged.append((key, value, kw)))
    trainer = SimpleNamespace(world_size=2, fit_loop=SimpleNamespace(_should_accumulate=lambda: False))
    callback._start = next(clock)
    batch = {"input_ids": torch.zeros(4, 128, dtype=torch.long)}  # 4 x 128 tokens on each of 2 ranks a step
    for index in range(14):
        callback.on_train_batch_start(trainer, module, batch, index)
        callback.on_train_batch_end(trainer, module, None, batch, index)
    assert callback.step_seconds[:3] == [1.0, 2.0, 0.5]
    assert [entry[0] for entry in logged] == [throughput.RUNNING_KEY] * 14
    assert all(entry[2] == {"prog_bar": True} for entry in logged)
    assert logged[1][1] == pytest.approx(1024 * 2 / 3.0)  # two steps in 3 s
    assert logged[-1][1] == pytest.approx(1024 / 0.5)  # the last 10 steps, all 0.5 s: the slow start has left
    assert callback.summary()["tokens_per_s"] == pytest.approx(1024 * 14 / sum(callback.step_seconds))
    assert callback.summary()["warmup_steps_included"] is False  # 14 steps, the default warm-up of 5 left out
    callback.warmup_steps = 20  # a run no longer than its warm-up: measured over every step, and the record says so
    assert callback.summary()["steps_measured"] == 14 and callback.summary()["warmup_steps_included"] is True


def test_a_two_process_run_logs_mfu_and_samples_per_s(tmp_path):
    callback = {"class_path": "callbacks.Throughput", "init_args": {"warmup_steps": 2, "peak_tflops": 0.5}}
    metrics = fit(tmp_path, devices=2, batch_size=2, steps=6, callbacks=[callback])
    perf = {key.removeprefix("perf/"): values[-1] for key, values in metrics.items() if key.startswith("perf/")}
    # The quickstart's blocks are 128 tokens: 2 sequences x 2 processes a step, timed over the 4 steps after warm-up.
    assert perf["steps_measured"] == 4 and perf["tokens_per_step"] == 512 and perf["warmup_steps_included"] == 0
    assert perf["tokens_per_s"] == pytest.approx(512 / (perf["step_time_ms_mean"] / 1000), rel=1e-6)
    assert perf["samples_per_s"] == pytest.approx(perf["tokens_per_s"] / 128, rel=1e-6)
    # MFU: the model's FLOPs per token x the tokens/s of one of the 2 processes, over the given peak of 0.5 TFLOPS.
    assert perf["flops_per_token"] == 983_040 and perf["peak_tflops"] == 0.5
    assert perf["mfu"] == pytest.approx(983_040 * perf["tokens_per_s"] / 2 / 0.5e12, rel=1e-6)
    assert perf["hfu"] == perf["mfu"]  # nothing recomputed
    assert len(metrics[throughput.RUNNING_KEY]) == 6 and min(metrics[throughput.RUNNING_KEY]) > 0  # every step
    # the run's record keeps every measured step's time, and its percentiles are theirs
    record = json.loads((tmp_path / "throughput.json").read_text())
    times = record["step_times_ms"]
    assert len(times) == 4 and record["step_time_ms_mean"] == pytest.approx(sum(times) / 4, rel=1e-9)
    assert min(times) <= record["step_time_ms_p10"] <= record["step_time_ms_p50"] <= record["step_time_ms_p90"] <= max(times)


@pytest.mark.parametrize(("global_step", "measured"), [(0, 4), (8, 9)])
def test_the_steady_state_leaves_out_the_delayed_updates_synchronous_warm_up_too(global_step, measured):
    """SlideFSDP with a delayed update after 10 synchronous steps (the 8B config's): the figures leave those 10 out, not
    only the callback's 5 warm-up steps, so no unhidden update enters them; a run resumed at step 8 has 2 of them left,
    under the callback's own 5."""
    from offload import SlideFSDPStrategy

    callback = Throughput(peak_tflops=1.0)
    strategy = SlideFSDPStrategy(update="delayed", delayed_update_warmup=10)
    trainer = SimpleNamespace(world_size=1, strategy=strategy, global_step=global_step)
    callback.on_train_start(trainer, SimpleNamespace(model=None, hparams={}, device=torch.device("cpu")))
    callback.step_seconds = [3.0] * 10 + [1.0] * 4
    callback.tokens_per_step = 512
    summary = callback.summary()
    assert summary["steps_measured"] == measured and summary["warmup_steps_included"] is False
    if global_step == 0:
        assert summary["step_time_ms_mean"] == 1000.0
