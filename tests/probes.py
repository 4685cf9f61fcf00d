"""Callbacks and hooks that tests load into real `python -m lit_fsdp` runs (the spawned ranks import them too)."""

from __future__ import annotations

import hashlib
import json
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from compress.torch_compat import ReduceScatter, checkpoint_wrapper
from lit_fsdp.strategy import CommHook


class RecordBatches(pl.Callback):
    """Appends ``{step, rank, digest}`` of every trained micro-batch to ``<path>.rank<r>.jsonl``."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        digest = hashlib.sha1(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]
        with open(f"{self.path}.rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "digest": digest}) + "\n")


class StopAtStep(pl.Callback):
    """Ends fit after ``step`` optimizer steps, as a killed job would, with max_steps unchanged."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class SaveLogits(pl.Callback):
    """At the end of fit, rank 0 saves the logits of a fixed input to ``path`` (all ranks run the forward)."""

    def __init__(self, path: str, seq_len: int = 16):
        self.path = path
        self.seq_len = seq_len

    def on_train_end(self, trainer, pl_module):
        vocab = pl_module.model.config.vocab_size
        input_ids = torch.arange(self.seq_len, device=pl_module.device).unsqueeze(0) % vocab
        with torch.no_grad():
            logits = pl_module(input_ids)
        if trainer.global_rank == 0:
            torch.save({"input_ids": input_ids.cpu(), "logits": logits.float().cpu()}, self.path)


class CountingReduceScatter(ReduceScatter):
    """The default reduce-scatter that also appends one line per call to ``<path>.rank<r>``: its numel and dtype."""

    def __init__(self, path: str):
        self.path = path

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        with open(f"{self.path}.rank{dist.get_rank()}", "a") as f:
            f.write(f"{input_tensor.numel()} {input_tensor.dtype}\n")
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class CountReduceScatters(CommHook):
    """A ``comm_hook`` for FSDP2Strategy: records every gradient reduce-scatter of every FSDP module (numel, dtype)."""

    def __init__(self, path: str):
        self.path = path

    def register(self, module: FSDPModule, mesh: DeviceMesh) -> None:
        module.set_custom_reduce_scatter(CountingReduceScatter(self.path))


class MaxResidentBlocks(pl.Callback):
    """Writes to ``path`` the most transformer blocks whose weights were on the device at once, seen from hooks of its own.

    It counts, at every block forward and at every parameter's gradient accumulation, the blocks with any
    parameter holding values (SlideFSDP binds parameters to an empty tensor when a block is not resident).
    """

    def __init__(self, path: str):
        self.path = path
        self.most = 0

    def on_train_start(self, trainer, pl_module):
        from lit_fsdp.parallelize import find_blocks

        blocks = [block for _, block in find_blocks(pl_module.model)]

        def count(*_):
            resident = sum(any(p.numel() > 0 for p in block.parameters()) for block in blocks)
            self.most = max(self.most, resident)

        for block in blocks:
            block.register_forward_pre_hook(count)
            block.register_forward_hook(count)
            for param in block.parameters():
                param.register_post_accumulate_grad_hook(count)

    def on_train_end(self, trainer, pl_module):
        with open(f"{self.path}.rank{trainer.global_rank}", "w") as f:
            f.write(str(self.most))


class RecordSamples(pl.Callback):
    """Appends ``{step, samples}`` (a digest per sequence) of every trained micro-batch to ``<path>.rank<r>.jsonl``."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        samples = [hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:12] for row in batch["input_ids"]]
        with open(f"{self.path}.rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "samples": samples}) + "\n")


class KillDuringSave(pl.Callback):
    """SIGKILLs every rank of the run once the checkpoint of ``step`` is written, before its manifest (rank 0)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_start(self, trainer, pl_module):
        import os
        import signal

        from lit_fsdp import checkpoints

        publish = checkpoints.publish

        def killing_publish(partial, path, manifest):
            if manifest["step"] >= self.step:
                for process in getattr(trainer.strategy.launcher, "procs", []):
                    os.kill(process.pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            return publish(partial, path, manifest)

        checkpoints.publish = killing_publish


class DieAtStep(pl.Callback):
    """The process of global rank ``rank`` kills itself (SIGKILL) when training reaches optimizer step ``step``."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import os
        import signal

        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class SignalGroupAtStep(pl.Callback):
    """Global rank 0 sends ``signal`` (a name: SIGINT, SIGTERM) to its process group, as a terminal's Ctrl-C or a
    scheduler would, at the end of optimizer step ``step``: the launcher and every rank it started receive it."""

    def __init__(self, signal: str, step: int):
        self.signal, self.step = signal, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import os
        import signal

        if trainer.global_rank == 0 and trainer.global_step == self.step:
            os.killpg(os.getpgrp(), getattr(signal, self.signal))


class FillDisk(pl.Callback):
    """Rank 0 fills the file system of ``path`` with a file there once training reaches optimizer step ``step``: a disk
    that had room at launch (the preflight's check) runs out during the run."""

    def __init__(self, path: str, step: int):
        self.path, self.step, self.done = path, step, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 0 and trainer.global_step >= self.step and not self.done:
            self.done = True
            try:
                with open(self.path, "wb") as filler:
                    while True:
                        filler.write(b"\0" * (1 << 20))
                        filler.flush()
            except OSError:  # no space left: what was asked
                pass


class FailHostSide(pl.Callback):
    """On global rank ``rank``, from optimizer step ``step`` on, SlideFSDP's host side raises: in the CPU update
    (``update``), the wait for a gradient's copy (``d2h``) or the CPU all-reduce (``reduce``)."""

    def __init__(self, rank: int, step: int, where: str, failed_at: str | None = None):
        """``failed_at``: a file the first injected failure writes its wall-clock time to."""
        self.rank, self.step, self.where, self.failed_at = rank, step, where, failed_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank != self.rank or trainer.global_step < self.step:
            return
        gradients = trainer.strategy.engine.gradients

        def fail(*args, **kwargs):
            import os
            import time

            if self.failed_at and not os.path.exists(self.failed_at):
                with open(self.failed_at, "w") as f:
                    f.write(repr(time.time()))
            raise RuntimeError(f"injected {self.where} failure")

        if self.where == "update":
            gradients.adam.update_rows = fail
        elif self.where == "d2h":
            gradients.transfers.synchronize = fail
        else:
            import offload.gradients

            offload.gradients.dist = type("FailingDist", (), {"all_reduce": staticmethod(fail)})


class RecordPlacement(pl.Callback):
    """Rank 0 writes to ``path`` how the strategy placed the network: its FSDP units (root first), each unit's
    forward and backward prefetch lists (as unit indices), the checkpoint-wrapped and the compiled modules."""

    def __init__(self, path: str):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank:
            return
        network = pl_module.model
        # fully_shard on a group makes every module of it an FSDPModule sharing one state: a unit is a state.
        # _get_fsdp_state and the prefetch lists are private (torch 2.13): FSDP2 has no getter for what
        # set_modules_to_forward_prefetch/set_modules_to_backward_prefetch set.
        units: dict = {}
        for name, module in network.named_modules():
            if isinstance(module, FSDPModule):
                units.setdefault(module._get_fsdp_state(), []).append(name)
        index = {state: i for i, state in enumerate(units)}
        wrapper = type(checkpoint_wrapper(torch.nn.Identity()))
        placement = {
            "units": list(units.values()),
            "forward_prefetch": [[index[s] for s in state._states_to_forward_prefetch] for state in units],
            "backward_prefetch": [[index[s] for s in state._states_to_backward_prefetch] for state in units],
            "checkpointed": [name for name, module in network.named_modules() if isinstance(module, wrapper)],
            # nn.Module.compile() leaves the compiled call here (private); __call__ runs it instead of forward
            "compiled": [name for name, module in network.named_modules()
                         if getattr(module, "_compiled_call_impl", None) is not None],
        }
        with open(self.path, "w") as f:
            json.dump(placement, f)


class RecordDtypes(pl.Callback):
    """Rank 0 writes to ``path`` the dtypes of the first block's weights and output in forward, and of the
    parameters, gradients and AdamW moments the optimizer steps on."""

    def __init__(self, path: str):
        self.path = path
        self.seen: dict = {}

    def on_train_start(self, trainer, pl_module):
        network = pl_module.model
        block = next(m for m in network.modules() if isinstance(m, FSDPModule) and m is not network)  # the first block

        def before(module, args):  # after FSDP2's own pre-hook: the gathered weights
            self.seen.setdefault("forward_weights", sorted({str(p.dtype) for p in module.parameters()}))

        def after(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self.seen.setdefault("forward_output", str(hidden.dtype))

        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = list(pl_module.model.parameters())
        self.seen["parameters"] = sorted({str(p.dtype) for p in params})
        self.seen["gradients"] = sorted({str(p.grad.dtype) for p in params if p.grad is not None})

    def on_train_end(self, trainer, pl_module):
        moments = trainer.optimizers[0].state.values()
        self.seen["adam_moments"] = sorted({str(s[name].dtype) for s in moments for name in ("exp_avg", "exp_avg_sq")})
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump(self.seen, f)


class RecordFirstGradients(pl.Callback):
    """Writes to ``path`` (rank 0) the first optimizer step's whole gradients, flattened in parameter order, before
    clipping: what the step's loss normalisation decides (FSDP2's sharded gradients are gathered, a collective)."""

    def __init__(self, path: str):
        self.path = path

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step:
            return
        parts = []
        for param in pl_module.model.parameters():
            if param.grad is not None:
                grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                parts.append(grad.detach().float().flatten().cpu())
        if trainer.global_rank == 0:
            torch.save(torch.cat(parts), self.path)


class SaveHostState(pl.Callback):
    """SlideFSDP: writes each rank's master rows and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step`` per trained
    piece, unit by unit) to ``<path>.rank<r>`` at the end of fit, after the strategy's teardown: what a script finds
    once fit returns. The probe waits for no update itself."""

    def __init__(self, path: str):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        self.host, self.adam = trainer.strategy.host, trainer.strategy.adam  # the strategy lets go of adam at teardown

    def on_fit_end(self, trainer, pl_module):  # Lightning calls it after strategy.teardown()
        moments = [[{key: value.clone() for key, value in optimizer.state[piece].items()} for piece in pieces]
                   if optimizer is not None else [] for optimizer, pieces in zip(self.adam.optimizers, self.adam.pieces)]
        torch.save({"master": [rows.clone() for rows in self.host.master], "moments": moments},
                   f"{self.path}.rank{trainer.global_rank}")
