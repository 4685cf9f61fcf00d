"""What a first CUDA run would get from the strategies without a GPU here: its process-group backend and its ``auto`` dtype.

The strategies are given a CUDA root device (``parallel_devices``, as Lightning's accelerator connector sets it) and
asked, without any process group; bf16 support is faked as a V100's (emulated, not native).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lit_fsdp.lifecycle import process_group_backend, resolve_dtype
from lit_fsdp.strategy import FSDP2Strategy
from lit_fsdp.commands.tune.memory import compute_dtype
from lit_fsdp.commands.tune.space import Candidate
from offload import SlideFSDPStrategy

GPU = torch.device("cuda", 0)


def on(device: torch.device, strategy):
    strategy.parallel_devices = [device]
    return strategy


def test_cpu_offload_on_a_gpu_gets_gloo_beside_nccl_for_its_cpu_gradient_norms():
    # Lightning's default would be plain nccl: "No backend type associated with device type cpu" at the first norm
    assert on(GPU, FSDP2Strategy(cpu_offload=True))._get_process_group_backend() == "cpu:gloo,cuda:nccl"


def test_without_cpu_collectives_the_backend_is_lightnings_default_for_the_device():
    assert on(GPU, FSDP2Strategy())._get_process_group_backend() == "nccl"
    assert on(torch.device("cpu"), FSDP2Strategy(cpu_offload=True))._get_process_group_backend() == "gloo"
    assert on(GPU, FSDP2Strategy(process_group_backend="gloo"))._get_process_group_backend() == "gloo"


def test_slide_fsdp_takes_the_same_choice():
    assert on(GPU, SlideFSDPStrategy())._get_process_group_backend() == "cpu:gloo,cuda:nccl"
    assert on(torch.device("cpu"), SlideFSDPStrategy())._get_process_group_backend() == "gloo"


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl", "NCCL"])
def test_a_backend_without_a_cpu_part_is_refused_with_cpu_offload_on_a_gpu(backend):
    for strategy in (FSDP2Strategy(cpu_offload=True, process_group_backend=backend),
                     SlideFSDPStrategy(process_group_backend=backend)):
        with pytest.raises(ValueError, match=r"no CPU part.*process_group_backend cpu:gloo,cuda:nccl or leave it unset"):
            on(GPU, strategy)._get_process_group_backend()


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo", "gloo", "ucc", "my_custom_backend"])
def test_a_backend_with_a_cpu_part_or_unknown_to_torch_is_kept(backend):
    assert process_group_backend(backend, GPU, "cpu_offload: true") == backend


def test_the_refusal_comes_in_preflight_before_any_worker_starts():
    trainer = SimpleNamespace(num_nodes=1, num_devices=2)
    strategy = on(GPU, FSDP2Strategy(cpu_offload=True, process_group_backend="nccl"))
    with pytest.raises(ValueError, match="cpu_offload: true runs collectives on CPU tensors"):
        strategy.preflight(trainer, module=None)


def _trainer(devices: int, accumulation: int = 1) -> SimpleNamespace:
    return SimpleNamespace(num_nodes=1, num_devices=devices, accumulate_grad_batches=accumulation, gradient_clip_val=None)


class Reached(Exception):
    """The preflight went past the knobs' checks to the model's sizes."""


def test_cpu_reduce_on_gpus_is_refused_in_preflight_and_allowed_on_one_gpu_or_on_cpu():
    strategy = on(GPU, SlideFSDPStrategy(grad_sync="cpu_reduce"))
    with pytest.raises(ValueError, match="grad_sync: cpu_reduce copies every rank's whole gradients.*use grad_sync: gpu_reduce"):
        strategy.preflight(_trainer(2), module=None)
    checked = []

    def reached(*args):
        checked.append(args)
        raise Reached

    for device, trainer in ((GPU, _trainer(1)), (torch.device("cpu"), _trainer(2))):
        allowed = on(device, SlideFSDPStrategy(grad_sync="cpu_reduce"))
        allowed.model_units = reached  # the host check's sizes come next: reached means not refused
        with pytest.raises(Reached):
            allowed.preflight(trainer, module=None)
    assert len(checked) == 2


def emulated_bf16(including_emulation: bool = True) -> bool:
    """A V100's answer: bf16 "works" (emulated, slower than fp32) but not in hardware."""
    return including_emulation


def test_auto_dtype_is_float32_on_a_gpu_that_only_emulates_bfloat16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulated_bf16)
    assert resolve_dtype("auto", GPU) == torch.float32
    assert on(GPU, FSDP2Strategy()).resolve_dtype("auto") == torch.float32
    assert resolve_dtype("bfloat16", GPU) == torch.bfloat16  # asked for by name: given
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compute_dtype(Candidate(), "cuda") == torch.float32  # the tuner's estimate resolves it the same way


def test_auto_dtype_is_bfloat16_on_a_gpu_with_it_in_hardware(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", GPU) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_a_delayed_update_accumulating_on_the_host_is_refused_in_preflight_and_on_the_device_is_not():
    strategy = on(GPU, SlideFSDPStrategy(update="delayed", accumulate_on="host"))
    with pytest.raises(ValueError, match="update: delayed with accumulate_on: host would rewrite .* set accumulate_on: "
                                         "device .* or update: auto"):
        strategy.preflight(_trainer(1, accumulation=2), module=None)
    on(GPU, SlideFSDPStrategy(update="delayed")).plan(_trainer(1, accumulation=2)).check_knobs()