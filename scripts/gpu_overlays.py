"""What the GPU check's runs lay over the shipped configs, per device: the device and its shape, the settings a step
changes, and ``merge`` to lay one over another. ``gpu_steps.py`` makes its rows from them.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from gpu_fit import HOST_MEMORY_VARIABLE, warmup_steps


def accelerator(device: str) -> dict[str, Any]:
    return {"accelerator": "gpu" if device == "cuda" else "cpu", "devices": 1}


def tiny(layers: int) -> dict[str, Any]:
    """The CPU mode's model and data: llama-tiny, at most 4 blocks, 2 x 64 tokens."""
    return {"model": {"preset": "llama-tiny", "config_overrides": {"num_hidden_layers": min(layers, 4)}},
            "data": {"init_args": {"vocab_size": 512, "seq_len": 64, "batch_size": 2}}}


def merge(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``more`` laid over it, key by key at every depth."""
    merged = dict(base)
    for key, value in more.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = merge(merged[key], value) if both else value
    return merged


def nest(settings: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` as ``{"a": {"b": 1}}``: a config override from dotted keys."""
    nested: dict[str, Any] = {}
    for dotted, value in settings.items():
        *parents, leaf = dotted.split(".")
        node = nested
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return nested


def as_shipped(device: str, layers: int | None = None) -> dict[str, Any]:
    """What a run of configs/llama_8b_offload.yaml as shipped overrides: the device and, on a GPU, the host memory
    the preflight may count on (and ``layers`` of its 32 blocks, when given); on the CPU, llama-tiny in float32."""
    if device == "cuda":
        init = {"host_memory_gb": float(os.environ[HOST_MEMORY_VARIABLE])}
        overrides = {"model": {"config_overrides": {"num_hidden_layers": layers}}} if layers else {}
    else:
        init, overrides = {"param_dtype": "float32"}, tiny(2)
    return {**overrides, "trainer": {**accelerator(device),
                                     "strategy": {"class_path": "offload.SlideFSDPStrategy", "init_args": init}}}


#: The control's settings, those of the 8B's records before the delayed update (step ``eight_b_fp32`` of
#: docs/gpu_runs/2026-11-26-h100/summary-2.json): the control step lays them over configs/llama_8b_offload.yaml,
#: whatever it ships, so that what the shipped settings gain is measured on the same machine in the same call.
EIGHT_B_BEFORE = {
    "data.init_args.batch_size": 8,  # 8 x 2048 = 16,384 tokens per optimizer step
    "trainer.gradient_clip_val": None,
    "trainer.strategy.init_args.optimizer_state_dtype": "float32",
    "trainer.strategy.init_args.update": "synchronous",  # without clipping: every update on arrival
    "trainer.strategy.init_args.gradient_slots": 2,  # max(2, window): the ring of those windows
    "trainer.strategy.init_args.activation_offload": "cpu",
}


def eight_b_before(device: str) -> dict[str, Any]:
    return merge(as_shipped(device), nest(EIGHT_B_BEFORE))


def one_b(device: str, batch: int | None = None, model: dict[str, Any] | None = None, **knobs: Any) -> dict[str, Any]:
    """configs/llama_1b.yaml on one device as shipped (its preset's 128k vocabulary), ``batch`` sequences of 2048
    tokens (default: the config's), ``model`` settings and the strategy's ``knobs`` laid over it; on the CPU,
    llama-tiny in float32."""
    if device == "cuda":
        overrides = {"data": {"init_args": {"batch_size": batch}}} if batch else {}
    else:
        overrides, knobs = tiny(16), {**knobs, "param_dtype": "float32", "compile_blocks": False}
    overrides = merge(overrides, {"model": model or {}, "trainer": accelerator(device)})
    if knobs:
        overrides["trainer"]["strategy"] = {"class_path": "lit_fsdp.strategy.FSDP2Strategy", "init_args": knobs}
    return overrides


def onebit(device: str) -> dict[str, Any]:
    """FSDP2 + 1-bit Adam, freezing at step 4: 4 Llama-1B-shaped blocks at 2 x 2048 (llama-tiny on the CPU)."""
    cuda = device == "cuda"
    return {
        "model": {"preset": "llama-1b" if cuda else "llama-tiny", "config_overrides": {"num_hidden_layers": 4 if cuda else 2}},
        "data": {"init_args": {"vocab_size": 32000 if cuda else 512, "seq_len": 2048 if cuda else 64, "batch_size": 2}},
        "trainer": {**accelerator(device), "gradient_clip_val": None,
                    "strategy": {"class_path": "lit_fsdp.strategy.FSDP2Strategy",
                                 "init_args": {"compression": {"method": "onebit_adam", "freeze_step": 4, "chunk_size": 128,
                                                               "bound": 1.0}}}},
    }


def slide_fsdp_syncs() -> list[dict[str, Any]]:
    return [{"class_path": "callbacks.HostSyncs", "init_args": {"warmup_steps": warmup_steps(), "steps": 5}}]


def onebit_callbacks() -> list[dict[str, Any]]:
    return [{"class_path": "callbacks.HostSyncs", "init_args": {"warmup_steps": 2, "steps": 8}},
            {"class_path": "callbacks.CommProfiler", "init_args": {"wait": 5, "warmup": 1, "active": 3}}]


EAGER = {"trainer": {"strategy": {"init_args": {"compile_blocks": False}}}}
LORA = {"model": {"lora": {"rank": 16, "alpha": 32}}}


#: The shipped 8B's update modes side by side, nothing else changed, against its shipped ``auto`` (the split): the
#: delayed update (stale by one step, from its first step), the other exact ones: synchronous (after the norm, waited
#: for), forward (after the norm in forward order, nothing speculated) and speculative (every unit, validated after
#: the backward).
DELAYED = {"trainer": {"strategy": {"init_args": {"update": "delayed", "delayed_update_warmup": 0}}}}
SYNCHRONOUS = {"trainer": {"strategy": {"init_args": {"update": "synchronous"}}}}
FORWARD = {"trainer": {"strategy": {"init_args": {"update": "forward"}}}}
SPECULATIVE = {"trainer": {"strategy": {"init_args": {"update": "speculative"}}}}

#: The activation plan chosen on the machine (offload/activation_plan.py) instead of every block recomputed.
AUTO_PLAN = {"trainer": {"strategy": {"init_args": {"activation_plan": "auto"}}}}
#: configs/llama_8b_offload_8k.yaml's 65,536 tokens in 4 micro-batches of 2 summed on the device, delayed: the 8k's
#: fastest setting by estimate, against which its exact single micro-batch is measured.
ACCUMULATED_DELAYED = {"trainer": {"accumulate_grad_batches": 4,
                                   "strategy": {"init_args": {"update": "delayed", "delayed_update_warmup": 0}}},
                       "data": {"init_args": {"batch_size": 2}}}


def tuned(device: str) -> dict[str, Any]:
    """What ``tune`` picked for the 8B on the H100 file with the delayed update in its space (docs/tuning.md), laid over
    the shipped config: the delayed update, the activation plan, and 4 micro-batches of 8 summed on the device instead
    of one of 32 (on the CPU, 2 micro-batches of llama-tiny's)."""
    micro_batches = {"data.init_args.batch_size": 8, "trainer.accumulate_grad_batches": 4} if device == "cuda" else {
        "trainer.accumulate_grad_batches": 2}
    return merge(merge(merge(as_shipped(device), DELAYED), AUTO_PLAN), nest(micro_batches))


def float8(device: str) -> dict[str, Any]:
    """``--model.float8 tensorwise`` (torchao's float8 training of the blocks' linear layers, torchtitan's default
    recipe); on a CPU without torchao (CI's default install) the step runs without it, its overlay, estimate and fit
    still checked."""
    if device == "cuda" or importlib.util.find_spec("torchao") is not None:
        return {"model": {"float8": "tensorwise"}}
    return {}


#: Mixtures of experts: Qwen3-30B-A3B's shape (preset qwen3-30b-a3b, random weights built on the host: nothing
#: downloaded) on synthetic data of its vocabulary; on the CPU the tiny Qwen3-MoE (2 blocks of 8 experts, 2 a token)
MOE_VOCABULARY = 151936
SYNTHETIC = "lit_fsdp.data.synthetic.SyntheticDataModule"


def moe(device: str, layers: int | None = None) -> dict[str, Any]:
    """``as_shipped`` (the device, the host memory, float32 on the CPU) with a mixture of experts for the model, from
    its preset (``pretrained_path`` unset) on synthetic data: qwen3-30b-a3b (``layers`` of its 48 blocks, when given)
    at its vocabulary and 32 x 2048 tokens a step; on the CPU qwen3-moe-tiny at ``tiny``'s 2 x 64, the plain loss."""
    if device == "cuda":
        model = {"pretrained_path": None, "preset": "qwen3-30b-a3b",
                 **({"config_overrides": {"num_hidden_layers": layers}} if layers else {})}
        shape = {"vocab_size": MOE_VOCABULARY, "seq_len": 2048, "batch_size": 32}
    else:
        model = {"pretrained_path": None, "preset": "qwen3-moe-tiny", "loss_chunk_tokens": 0}
        shape = tiny(2)["data"]["init_args"]
    return merge(as_shipped(device), {"model": model, "data": {"class_path": SYNTHETIC, "init_args": shape}})


def fsdp2_moe(device: str) -> dict[str, Any]:
    """configs/moe.yaml (FSDP2) on one device: on the GPU 2 of Qwen3-30B-A3B's blocks (1.9B parameters, every expert)
    at its vocabulary, 4 x 2048 tokens, in bfloat16, the loss in chunks; on the CPU its tiny preset at 2 x 64."""
    if device == "cuda":
        overrides = {"model": {"preset": "qwen3-30b-a3b", "config_overrides": {"num_hidden_layers": 2},
                               "loss_chunk_tokens": 4096},
                     "data": {"init_args": {"vocab_size": MOE_VOCABULARY, "seq_len": 2048, "batch_size": 4}}}
    else:
        overrides = {"data": {"init_args": tiny(2)["data"]["init_args"]}}
    return merge(overrides, {"trainer": accelerator(device)})


#: The first window's steps: each path no GPU has run yet, once, on FIRST_BLOCKS of the 8B's blocks at 4 x 2048
#: (llama-tiny's 2 on the CPU), each under a deadline of its own so that a defect costs its step, not the window.
FIRST_BLOCKS = 2
HOST_BLOCKS = {"trainer": {"strategy": {"init_args": {"activation_plan": {"host": FIRST_BLOCKS},
                                                       "activation_checkpointing": 0, "activation_offload": "none"}}}}
DEVICE_SUMS = {"trainer": {"accumulate_grad_batches": 2, "strategy": {"init_args": {"accumulate_on": "device"}}}}
BF16_MASTER = {"trainer": {"strategy": {"init_args": {"master_dtype": "bfloat16"}}}}
#: Clipping at a norm every gradient exceeds, a split of the last block: each speculated update rolled back and
#: applied again, clipped, behind the next forward, the first block's after the norm.
ROLLBACK = {"trainer": {"gradient_clip_val": 1.0e-6,
                        "strategy": {"init_args": {"update": "split", "speculated_blocks": 1}}}}


def offload_strategy(device: str, dtype: str, **knobs: Any) -> dict[str, Any]:
    init = {"window": 2, "param_transfer": "full", "grad_sync": "gpu_reduce", "param_dtype": dtype, "reduce_dtype": "auto",
            "activation_checkpointing": 1, "activation_offload": "cpu", **knobs}
    if device == "cuda":
        # The VM's memory is granted as it is used: MemAvailable starts far below what it gets (--host-memory-gb).
        init["host_memory_gb"] = float(os.environ[HOST_MEMORY_VARIABLE])
    return {"class_path": "offload.SlideFSDPStrategy", "init_args": init}
