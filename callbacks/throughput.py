"""Tokens/s, samples/s, step-time percentiles and MFU per optimizer step, warm-up steps discarded."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from transformers import PretrainedConfig

from callbacks.run_folder import log_metrics, write_json
from lit_fsdp.device_peaks import matmul_format, peak_tflops
from lit_fsdp.flops import lora_flops_per_token, matmul_shape
from lit_fsdp.reporting import strategy_report


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, as numpy's default."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def compute_dtype(trainer: pl.Trainer) -> torch.dtype:
    """The dtype the matmuls run in: a lit_fsdp strategy's resolved ``param_dtype``, else the trainer's precision."""
    return strategy_report(trainer).compute_dtype()


#: The progress bar's ``tok/s`` (also logged every ``log_every_n_steps``): the mean over the last steps, warm-up included.
RUNNING_KEY = "perf/tokens_per_s_running"
RUNNING_STEPS = 10


class Throughput(pl.Callback):
    """Times each optimizer step (device-synchronised) and reports tokens/s, samples/s, step-time statistics and MFU.

    A step's time runs from the end of the previous step (or the start of training) to its own end,
    so time spent between steps, in data loading or logging, is counted.

    MFU is ``flops_per_token x tokens/s per device / peak``: FLOPs from the model's config
    (``lit_fsdp.flops``, activation-checkpointing recompute not counted; ``hfu`` counts it) and the
    peak of the GPU at the strategy's ``param_dtype`` (``lit_fsdp.device_peaks``) or ``peak_tflops``.
    Without a known peak (CPU, an unlisted GPU) MFU is null and rank 0 says so in one info line: expected
    on a CPU, so not a warning. With ``--model.float8`` the peak stays the bf16 one (torchtitan's convention: MFU
    then compares with bf16 runs, and the head and attention do not run in float8); the figures say so in ``float8``
    (the recipe) and ``mfu_peak_format`` (``bf16``, or ``given`` for ``peak_tflops``), and rank 0 in one info line.

    While training, the tokens/s of the last ``RUNNING_STEPS`` steps are logged as ``perf/tokens_per_s_running``
    and show in the progress bar as ``tok/s``. The run's figures are logged as ``perf/*`` at the end of fit and
    written by rank 0 to ``<default_root_dir>/throughput.json``, with every measured step's time (``step_times_ms``).
    """

    def __init__(self, warmup_steps: int = 5, peak_tflops: float | None = None):
        """
        Args:
            warmup_steps: Optimizer steps left out of the statistics (compilation, allocator and cache warm-up);
                more where the strategy's first steps run unlike the rest (``StrategyReport.unsteady_steps``: SlideFSDP's
                synchronous updates before its delayed ones).
            peak_tflops: Peak TFLOPS of one device for MFU, instead of the built-in GPU table (needed on CPU
                or an unlisted GPU).
        """
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"Throughput peak_tflops={peak_tflops} must be > 0 (TFLOPS of one device), or null")
        self.warmup_steps = warmup_steps
        self.unsteady_steps = 0  # the strategy's first steps unlike the rest still to come, at train start
        self.peak_tflops = peak_tflops
        self.step_seconds: list[float] = []
        self.tokens_per_step = 0
        self.samples_per_step = 0
        self.seq_len = 0
        self.world_size = 1
        self.recompute_flops = lambda config, seq_len: 0  # the strategy's, at train start
        self.model_config: PretrainedConfig | None = None
        self.lora: dict | None = None  # LoRA's settings: its adapters train, the base gets no weight gradients
        self.peak = peak_tflops  # the given peak, or the table's once training starts
        self.float8: str | None = None  # the blocks' float8 recipe (--model.float8); None: off
        self._start = 0.0
        self._new_step = True

    @staticmethod
    def _sync(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.world_size = trainer.world_size
        report = strategy_report(trainer)
        self.recompute_flops = report.recompute_flops
        unsteady = report.unsteady_steps()
        self.unsteady_steps = max(0, unsteady - trainer.global_step) if unsteady else 0  # a resumed run may be past them
        config = getattr(getattr(pl_module, "model", None), "config", None)
        self.model_config, problems = None, []
        if not isinstance(config, PretrainedConfig):
            problems.append(f"{type(pl_module).__name__}.model has no Hugging Face config to count FLOPs from")
        else:
            try:
                matmul_shape(config)
                self.model_config = config
                # a LoRA run trains its adapters (and chosen modules): no weight gradients for the frozen base
                self.lora = pl_module.hparams.get("lora")
            except ValueError as error:
                problems.append(str(error))
        self.peak = self.peak_tflops
        recipe = (getattr(pl_module, "hparams", None) or {}).get("float8", "off")
        self.float8 = None if recipe in (None, "off") else recipe
        if self.float8 is not None:
            rank_zero_info(f"Throughput: --model.float8 {self.float8}: MFU is counted against the "
                           f"{'bf16' if self.peak is None else 'given'} peak, not the fp8 one, as torchtitan does")
        if self.peak is None:
            device = pl_module.device
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            # float8: the bf16 peak whatever param_dtype is, so that MFU compares with bf16 runs
            dtype = torch.bfloat16 if self.float8 is not None else compute_dtype(trainer)
            self.peak = peak_tflops(name, dtype)
            if self.peak is None:
                problems.append(
                    f"no peak for {name!r} in {matmul_format(dtype)}; give one device's peak TFLOPS with "
                    "--peak_tflops on fit's command line (or the callback's init_args.peak_tflops)"
                )
        if problems:
            rank_zero_info(f"Throughput: MFU is null: {'; '.join(problems)}")
        self._sync(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._new_step:
            self.tokens_per_step, self.samples_per_step, self._new_step = 0, 0, False
        samples, self.seq_len = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
        self.tokens_per_step += samples * self.seq_len * trainer.world_size
        self.samples_per_step += samples * trainer.world_size

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        # Boundary to boundary: the time between steps (data loading, logging) counts too.
        self._sync(pl_module.device)
        now = time.perf_counter()
        self.step_seconds.append(now - self._start)
        self._start, self._new_step = now, True
        recent = self.step_seconds[-RUNNING_STEPS:]
        pl_module.log(RUNNING_KEY, self.tokens_per_step * len(recent) / sum(recent), prog_bar=True)

    @property
    def left_out(self) -> int:
        """The first steps the statistics leave out: the warm-up, or the strategy's unsteady steps if more."""
        return max(self.warmup_steps, self.unsteady_steps)

    def summary(self) -> dict[str, Any]:
        """Statistics over the steps after warm-up (all steps if there are no more than the warm-up, and then
        ``warmup_steps_included`` is true)."""
        steps = self.step_seconds[self.left_out :] or self.step_seconds
        if not steps:
            return {}
        ms = [s * 1000 for s in steps]
        tokens_per_s = self.tokens_per_step * len(steps) / sum(steps)
        summary = {
            "steps_measured": len(steps),
            # a run no longer than the warm-up is measured over every step, warm-up included: the record says so
            "warmup_steps_included": len(self.step_seconds) <= self.left_out,
            "step_time_ms_mean": statistics.fmean(ms),
            "step_time_ms_p10": percentile(ms, 10),
            "step_time_ms_p50": percentile(ms, 50),
            "step_time_ms_p90": percentile(ms, 90),
            "step_time_ms_p95": percentile(ms, 95),
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": self.samples_per_step * len(steps) / sum(steps) if self.samples_per_step else None,
            "flops_per_token": None, "peak_tflops": self.peak, "mfu": None, "hfu": None,
        }
        if self.model_config is not None and self.seq_len:
            model_flops = lora_flops_per_token(self.model_config, self.seq_len, self.lora)
            summary["flops_per_token"] = model_flops
            if self.peak is not None:
                per_device = tokens_per_s / self.world_size / (self.peak * 1e12)
                recompute = self.recompute_flops(self.model_config, self.seq_len)
                summary["mfu"] = model_flops * per_device
                summary["hfu"] = (model_flops + recompute) * per_device
        if self.float8 is not None:  # which peak MFU was counted against, and why not the fp8 one
            summary.update(float8=self.float8, mfu_peak_format="bf16" if self.peak_tflops is None else "given")
        return summary

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        summary = self.summary()
        if not summary:
            return
        # loggers take numbers: a flag is logged as 0 or 1 (the results record keeps it a boolean)
        log_metrics(trainer, {f"perf/{key}": float(value) if isinstance(value, bool) else value
                              for key, value in summary.items() if value is not None and not isinstance(value, str)})
        # every measured step's time beside the statistics: the run's own record of its spread
        measured = self.step_seconds[self.left_out :] or self.step_seconds
        write_json(trainer, "throughput.json", {**summary, "step_times_ms": [s * 1000 for s in measured]})
