"""One rank of one peer of ``scripts/bench_peers.py``: the model, the synthetic batches, the timed steps, and the rank's
record in ``OUT/rank<N>.json``. ``bench_peers.py`` starts it under ``torchrun`` (a process per rank, RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set) with the run's spec, a JSON file it writes.

Started as:

    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/peers_worker.py --spec SPEC --out OUT

SlideFSDP is not run here: ``bench_peers.py`` runs it through ``python -m lit_fsdp fit``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file under torchrun: the checkout importable

from lit_fsdp.errors import error_line  # noqa: E402
from lit_fsdp.loss import LossHead  # noqa: E402
from lit_fsdp.presets import build_config  # noqa: E402

GIB = 2**30


def rank() -> int:
    return int(os.environ.get("RANK", 0))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def device_of(spec: dict[str, Any]) -> torch.device:
    if spec["device"] == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def build_model(spec: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """The spec's Llama shape with random float32 weights (seeded) on ``device``: activation checkpointing on every
    block as SlideFSDP's ``activation_checkpointing: 1``, and lit_fsdp's chunked loss head as its default
    ``loss_chunk_tokens`` (the full-vocabulary logits never exist at once)."""
    from transformers import AutoModelForCausalLM

    config = build_config(spec["preset"], {"num_hidden_layers": spec["layers"]})
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    # transformers 5.x renamed gradient_checkpointing_enable; the GPU machine's release may predate the new name
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    if spec["loss_chunk_tokens"]:
        LossHead.convert(model.get_output_embeddings(), spec["loss_chunk_tokens"])
    model.train()
    return model


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's groups as lit_fsdp's CausalLM makes them: matrices and embeddings decayed, norms not."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trained if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}]


def batches(spec: dict[str, Any]) -> list[torch.Tensor]:
    """This rank's token ids, one ``batch_size x (seq_len + 1)`` tensor a step: uniform random ids, seeded by the
    spec's seed and the rank, the same for every peer."""
    generator = torch.Generator().manual_seed(spec["seed"] * 1000 + rank())
    vocab = build_config(spec["preset"]).vocab_size
    return [torch.randint(vocab, (spec["batch_size"], spec["seq_len"] + 1), generator=generator)
            for _ in range(spec["steps"])]


def loss_of(call: Callable[..., Any], module: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of ``tokens`` through ``call`` (the model, or an engine that wraps ``module``)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    head = module.get_output_embeddings()
    if isinstance(head, LossHead):  # the head returns the loss as the model's "logits"
        with head.targets(labels):
            return call(input_ids=inputs).logits
    logits = call(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class StepClock:
    """Each optimizer step's time, boundary to boundary (device-synchronised), as ``callbacks.Throughput`` times it."""

    def __init__(self, device: torch.device):
        self.device, self.times_ms, self.losses = device, [], []
        self.start = 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        self.sync()
        self.start = time.perf_counter()

    def tick(self, loss: torch.Tensor) -> None:
        self.sync()
        now = time.perf_counter()
        self.times_ms.append((now - self.start) * 1000)
        self.start = now
        self.losses.append(float(loss.detach().float()))  # after the clock: its host sync is not timed


def loop(spec: dict[str, Any], device: torch.device, step: Callable[[torch.Tensor], torch.Tensor]) -> StepClock:
    """``spec['steps']`` steps of ``step(tokens) -> loss`` over this rank's batches, timed."""
    clock = StepClock(device)
    clock.begin()
    for tokens in batches(spec):
        loss = step(tokens.to(device, non_blocking=True))
        clock.tick(loss)
        clock.begin()  # the loss's read is left out of the next step's time
    return clock


# --- the peers -------------------------------------------------------------------------------------------------


def deepspeed_peer(spec: dict[str, Any], stage: int) -> StepClock:
    """DeepSpeed ZeRO-``stage`` with its optimizer (DeepSpeedCPUAdam) on the host; at stage 3 the parameters too."""
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    device = device_of(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed()  # the accelerator's backend: nccl on GPUs, gloo on the CPU without oneCCL
    pin = device.type == "cuda"
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    adamw = spec["adamw"]
    config = {
        "train_micro_batch_size_per_gpu": spec["batch_size"], "gradient_accumulation_steps": 1,
        "gradient_clipping": adamw["clip"], "bf16": {"enabled": True}, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": adamw["lr"], "betas": adamw["betas"], "eps": adamw["eps"],
                                                  "weight_decay": adamw["weight_decay"]}},
        "steps_per_print": 2**30, "wall_clock_breakdown": False,
    }
    model = build_model(spec, device)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, adamw["weight_decay"]),
                                      config=config)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = loss_of(engine, engine.module, tokens)
        engine.backward(loss)
        engine.step()
        return loss

    return loop(spec, device, step)


def fsdp2_peer(spec: dict[str, Any]) -> StepClock:
    """FSDP2 (``fully_shard`` per block, then the root) with ``CPUOffloadPolicy``: sharded float32 parameters,
    gradients and the AdamW step on the host; bfloat16 compute and float32 reduction, as lit_fsdp's FSDP2Strategy."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = device_of(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # gradient norms of CPU DTensors take gloo beside NCCL
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (world(),))
    model = build_model(spec, device)
    policy = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}
    for block in model.model.layers:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    adamw = spec["adamw"]
    optimizer = torch.optim.AdamW(parameter_groups(model, adamw["weight_decay"]), lr=adamw["lr"],
                                  betas=tuple(adamw["betas"]), eps=adamw["eps"])

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model, model, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), adamw["clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    try:
        return loop(spec, device, step)
    finally:
        dist.destroy_process_group()


def lightning_peer(spec: dict[str, Any]) -> StepClock:
    """Lightning's ``FSDPStrategy(cpu_offload=True)`` (FSDP1, every decoder block a unit) in a Trainer with
    ``precision="bf16-mixed"``; clipped through the root FSDP module, as Lightning's FSDP documentation says."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    device = device_of(spec)
    adamw = spec["adamw"]

    class Peer(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(spec, torch.device("cpu"))  # FSDP moves each unit's shard where it belongs

        def training_step(self, tokens: torch.Tensor, index: int) -> torch.Tensor:
            return loss_of(self.model, self.model, tokens)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(parameter_groups(self.model, adamw["weight_decay"]), lr=adamw["lr"],
                                     betas=tuple(adamw["betas"]), eps=adamw["eps"])

        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                        gradient_clip_algorithm: Any = None) -> None:
            # Lightning's FSDP precision refuses clipping by norm: FSDP1's root module computes the sharded norm
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.clock = StepClock(device)

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.clock.begin()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, index: int) -> None:
            self.clock.tick(outputs["loss"])
            self.clock.begin()

    clock = Clock()
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=world(), precision="bf16-mixed",
        strategy=FSDPStrategy(cpu_offload=True, auto_wrap_policy={LlamaDecoderLayer}), max_steps=spec["steps"],
        gradient_clip_val=adamw["clip"], callbacks=[clock], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(Peer(), train_dataloaders=torch.utils.data.DataLoader(batches(spec), batch_size=None))
    return clock.clock


PEERS: dict[str, Callable[[dict[str, Any]], StepClock]] = {
    "deepspeed_zero3_offload": lambda spec: deepspeed_peer(spec, 3),
    "deepspeed_zero2_offload": lambda spec: deepspeed_peer(spec, 2),
    "fsdp2_cpu_offload": fsdp2_peer,
    "lightning_fsdp_cpu_offload": lightning_peer,
}


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for package in ("torch", "deepspeed", "lightning", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def memory(device: torch.device) -> dict[str, Any]:
    """This rank's peaks: host RSS (``ru_maxrss``, KiB on Linux) and, on a GPU, the device's allocated and reserved."""
    found: dict[str, Any] = {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
                             "device_peak_gib": None, "device_peak_reserved_gib": None, "device_name": device.type}
    if device.type == "cuda":
        found.update(device_peak_gib=torch.cuda.max_memory_allocated(device) / GIB,
                     device_peak_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB,
                     device_name=torch.cuda.get_device_name(device))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, required=True, help="the run's spec (JSON), as bench_peers.py writes it")
    parser.add_argument("--out", type=Path, required=True, help="folder for this rank's record, rank<N>.json")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    record: dict[str, Any] = {"rank": rank(), "world_size": world(), "versions": versions()}
    path = args.out / f"rank{rank()}.json"
    try:
        clock = PEERS[spec["peer"]](spec)
    except BaseException as error:  # the record says how it failed; torchrun stops the other ranks
        record["error"] = f"{type(error).__name__}: {error_line(error)}"
        path.write_text(json.dumps(record))
        raise
    record.update(step_times_ms=clock.times_ms, losses=clock.losses, **memory(device_of(spec)))
    path.write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
