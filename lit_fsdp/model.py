"""The LightningModule: a Hugging Face causal LM with next-token loss, AdamW and a warm-up + cosine schedule."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics.aggregation import MeanMetric
import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig

from lit_fsdp import float8 as float8_compute
from lit_fsdp import lora as lora_adapters
from lit_fsdp import experts_kernel, router
from lit_fsdp.hub import model_folder
from lit_fsdp.data.tokenizer import tokenizer_files
from lit_fsdp.errors import OneLineError, RunError
from lit_fsdp.lightning_compat import reopen_cut_epoch
from lit_fsdp.lora import LoraConfig
from lit_fsdp.loss import IGNORE_INDEX, LossHead, step_normalised, target_count
from lit_fsdp.presets import build_config
from lit_fsdp.weights import check_pretrained, has_weights, init_by_unit, load_by_shard, parameters_on_meta

try:  # transformers >= 5
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4.x
    from transformers.modeling_utils import no_init_weights


class CausalLM(pl.LightningModule):
    """A causal language model from a named preset, a local Hugging Face folder or a Hub model, trained from scratch or
    fine-tuned."""

    def __init__(
        self,
        preset: str = "gpt2-tiny",
        pretrained_path: str | None = None,
        config_overrides: dict[str, Any] | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        schedule_steps: int | None = None,
        loss_chunk_tokens: int = 1024,
        lora: LoraConfig | None = None,
        float8: float8_compute.Float8 = "off",
    ):
        """
        Args:
            preset: Model shape from ``lit_fsdp.presets`` (random init): gpt2-tiny, gpt2-small, gpt2-124m,
                llama-tiny, llama-1b, llama-8b, qwen2.5-14b, qwen2.5-32b. Ignored when ``pretrained_path`` is set.
            pretrained_path: Hugging Face model (config.json + safetensors) to start from: a local folder, or a Hub
                name owner/name[@revision] read from the Hub cache (downloaded when online, HF_HUB_OFFLINE unset).
            config_overrides: Hugging Face config fields to change, e.g. ``{n_layer: 6}``.
            learning_rate: Peak AdamW learning rate.
            weight_decay: AdamW weight decay, applied to matrices and embeddings only.
            betas: AdamW betas.
            warmup_steps: Linear warm-up steps before the cosine decay.
            min_lr_ratio: Final learning rate as a fraction of the peak.
            schedule_steps: Optimizer steps the warm-up and cosine decay span; default the run's max_steps. A run
                stopped early to be continued later (a warm start) gives the whole run's length, so the continuation
                goes on along the same schedule.
            loss_chunk_tokens: Tokens whose full-vocabulary logits the loss makes at once (the head computes the
                loss and its gradient chunk by chunk, so a step's whole logits never exist); 0 for the plain loss.
            lora: Train low-rank adapters on the frozen model instead of the model, e.g. ``{rank: 16, alpha: 32}``,
                and chosen modules whole beside them (``train: [embeddings, norms]``) (``lit_fsdp.lora.LoraConfig``);
                checkpoints then hold only what trains.
            float8: Matmuls of the transformer blocks' nn.Linear layers in float8 through torchao's float8 training
                (torchtitan's recipes): ``tensorwise`` (one scale per tensor) or ``rowwise`` (one per row); the LM
                head, the embeddings and layers with dims not multiples of 16 stay in param_dtype, and so do LoRA's
                adapters. Needs torchao (``pip install -e ".[float8]"``), Llama-like blocks (GPT-2's Conv1D layers
                do not convert) and a GPU of compute capability 8.9+ (H100, H200); on CPU torchao emulates it, for
                tests: same rounding, no speed-up (``lit_fsdp.float8``).
        """
        super().__init__()
        self._lora = lora_adapters.as_config(lora)
        lora = None if self._lora is None else asdict(self._lora)  # saved as a plain dict: checkpoints load weights_only
        self.save_hyperparameters()  # the name as given: a run resumed elsewhere resolves it in that machine's cache
        self._logged_nonfinite_steps: int | None = None
        # A Hub name is resolved (and downloaded) once, here, before any process starts: the processes started later
        # find its snapshot through the environment (hub.RESOLVED_ENV), and every reader takes this folder.
        self.pretrained_folder = pretrained_path and model_folder(pretrained_path, "--model.pretrained_path")
        # An unknown preset, an unreadable config.json or a bad override fails here, before any process starts.
        config = pretrained_config(pretrained_path, self.pretrained_folder) if pretrained_path else build_config(preset)
        check_overrides(config, config_overrides)
        try:
            self.hf_config()
        except Exception as error:  # transformers' own validation (strict dataclasses in 5.x) raises its own types
            raise OneLineError(f"--model.config_overrides {config_overrides} is refused by the model's config: "
                               f"{_first_line(error)}; fix or remove that field") from error
        if schedule_steps is not None and schedule_steps <= warmup_steps:
            raise ValueError(f"--model.schedule_steps {schedule_steps} must exceed --model.warmup_steps {warmup_steps}; "
                             "give the whole run's optimizer steps, or leave it unset for max_steps")
        if loss_chunk_tokens < 0:
            raise ValueError(f"--model.loss_chunk_tokens is {loss_chunk_tokens}; give a positive number of tokens, "
                             "or 0 for the plain loss")
        if self.pretrained_folder is not None or self._lora is not None or float8 != "off":
            with torch.device("meta"):  # the network's shape alone, to check what follows against it
                network = AutoModelForCausalLM.from_config(self.hf_config())
            # Here, in the launcher, before any process starts: each would say it once
            if self.pretrained_folder is not None and has_weights(self.pretrained_folder):  # (estimate reads the config
                check_pretrained(network, self.pretrained_folder)  # alone) tensors missing, unexpected, mis-shaped
            float8_compute.check(float8, network)  # an unknown recipe, torchao missing or nothing to convert
            if self._lora is not None:  # an unknown target or trained module
                lora_adapters.attach(network, self._lora)
        self.model: torch.nn.Module | None = None
        self.expert_load: router.ExpertLoad | None = None  # a mixture of experts' tokens per expert (configure_model)
        self.val_loss = MeanMetric()
        self._init_seed = 0
        self._base_record: dict[str, Any] | None = None
        self._dropout_key = (-1, -1)  # (optimizer step, micro-batch within it) of LoRA's last dropout masks

    # --- model -----------------------------------------------------------------------------------

    def hf_config(self, datamodule: Any = None) -> PretrainedConfig:
        """The Hugging Face config this module builds, with the vocabulary size of the data (``datamodule``, default
        the trainer's) when it has one."""
        hp = self.hparams
        if self.pretrained_folder is not None:
            config = AutoConfig.from_pretrained(self.pretrained_folder, local_files_only=True, trust_remote_code=False)
            for key, value in (hp.config_overrides or {}).items():
                setattr(config, key, value)
            return config
        if datamodule is None and self._trainer is not None:
            datamodule = getattr(self._trainer, "datamodule", None)
        overrides = {}
        if getattr(datamodule, "vocab_size", None):
            # The preset's special token ids belong to its own vocabulary: take the data's (or none).
            eos = getattr(datamodule.tokenizer, "eos_token_id", None)
            overrides = {"vocab_size": datamodule.vocab_size, "bos_token_id": eos, "eos_token_id": eos}
        return build_config(hp.preset, {**overrides, **(hp.config_overrides or {})})

    def configure_model(self) -> None:
        """Build the network with its parameters on the meta device; the strategy shards and fills them."""
        if self.model is not None:
            return
        if self._lora is not None:
            self._check_lora_strategy()
        config = self.hf_config()
        with parameters_on_meta(), no_init_weights():
            self.model = AutoModelForCausalLM.from_config(config)
        self.model.tie_weights()  # no_init_weights also skips the tying that init_weights does
        self.model.config.use_cache = False
        experts, top_k = router.expert_count(config), router.experts_per_token(config)
        self.expert_load = router.ExpertLoad(experts, top_k) if experts and top_k else None
        if self.expert_load is not None:
            from lit_fsdp.reporting import StrategyReport

            strategy = self._trainer.strategy if self._trainer is not None else None
            reason = experts_kernel.fallback(
                self.model, getattr(strategy, "root_device", self.device), getattr(strategy, "compile_blocks", False),
                strategy.compute_dtype() if isinstance(strategy, StrategyReport) else None)
            if reason:
                rank_zero_warn(f"lit_fsdp: {reason}", category=UserWarning)
        if self.hparams.loss_chunk_tokens:
            LossHead.convert(self.model.get_output_embeddings(), self.hparams.loss_chunk_tokens)
        if self.hparams.float8 != "off":  # before LoRA: torchao's swap would drop the adapters' hooks and parameters
            strategy = self._trainer.strategy if self._trainer is not None else None
            float8_compute.convert(self.model, self.hparams.float8, getattr(strategy, "root_device", self.device),
                                   getattr(strategy, "block_class", None))
        if self._lora is not None:
            lora_adapters.attach(self.model, self._lora)
        self._init_seed = torch.initial_seed()

    def _check_lora_strategy(self) -> None:
        """Refuse LoRA on a strategy that would save the frozen base in every checkpoint (DDP)."""
        from lit_fsdp.lifecycle import CausalLMStrategy  # FSDP2Strategy and offload.SlideFSDPStrategy

        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy is not None and not isinstance(strategy, CausalLMStrategy):
            raise RunError(f"--model.lora needs lit_fsdp.strategy.FSDP2Strategy or offload.SlideFSDPStrategy, which "
                           f"save adapter-only checkpoints; {type(strategy).__name__} does not: use FSDP2Strategy (with "
                           "cpu_offload true to keep the base on the host) or SlideFSDPStrategy")

    def initialize_weights(self, blocks: list[tuple[str, torch.nn.Module]]) -> None:
        """Write initial values into the sharded parameters: pretrained rows or a seeded random init."""
        assert self.model is not None
        if self.pretrained_folder is not None:
            load_by_shard(self.model, self.pretrained_folder, skip=lora_adapters.adapter_names(self.model))
        else:
            init_by_unit(self.model, blocks, self.model._init_weights, self._init_seed)
        if self._lora is not None:
            lora_adapters.init_adapters(self.model, self._init_seed)
            path = self.pretrained_folder  # a Hub name's snapshot folder: its path names the commit
            base = str(Path(path).resolve()) if path else f"preset {self.hparams.preset}"
            self._base_record = lora_adapters.base_record(self.model, self._lora, base, self._init_seed)

    @property
    def adapter_checkpoint(self) -> dict[str, Any] | None:
        """With LoRA, what checkpoints record of the frozen base they leave out (``lora.base_record``); None: they
        hold the whole model."""
        return self._base_record

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; ``position_ids`` that restart at 0 mark packed samples, and transformers keeps each sample's attention
        inside it (``masking_utils.find_packed_sequence_indices``: SDPA's mask on CPU, flash-attention's varlen path)."""
        return self.model(input_ids=input_ids, position_ids=position_ids).logits

    # --- steps -----------------------------------------------------------------------------------

    def _loss(self, batch: dict[str, torch.Tensor], routed: bool = False) -> tuple[torch.Tensor, Any]:
        """The mean loss over the batch's target tokens (labels other than -100), and the model's outputs; ``routed``:
        with a mixture of experts' router logits and auxiliary loss (``output_router_logits``)."""
        head = self.model.get_output_embeddings()
        kwargs = {"position_ids": batch.get("position_ids")}
        if routed:
            kwargs["output_router_logits"] = True
        if isinstance(head, LossHead):  # the head returns the loss, inside the model's (FSDP root's) forward
            with head.targets(batch["labels"]):
                outputs = self.model(input_ids=batch["input_ids"], **kwargs)
            return outputs.logits, outputs
        outputs = self.model(input_ids=batch["input_ids"], **kwargs)
        loss = F.cross_entropy(outputs.logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        return loss, outputs

    def on_fit_start(self) -> None:
        entropy_rate = getattr(self.trainer.datamodule, "entropy_rate", None)
        if entropy_rate is not None:
            for logger in self.loggers:
                logger.log_metrics({"data/entropy_rate": entropy_rate}, step=0)

    def on_train_start(self) -> None:
        # A resumed checkpoint restores its schedulers' peak learning rate; the one configured now is the one asked for.
        for config in self.trainer.lr_scheduler_configs:
            previous = follow_learning_rate(config.scheduler, self.hparams.learning_rate)
            if previous is not None:
                rank_zero_info(f"--model.learning_rate {self.hparams.learning_rate:g} replaces the resumed checkpoint's "
                               f"{previous:g}: the schedule goes on from step {config.scheduler.last_epoch} at the new peak")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self._lora is not None and self._lora.dropout:
            self._seed_dropout()
        loss, outputs = self._loss(batch, routed=self.expert_load is not None)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        if "step_targets" in batch:  # else every micro-batch holds as many targets: the mean of means is the mean
            trainer = self.trainer
            loss = step_normalised(loss, batch["labels"], batch["step_targets"], trainer.world_size,
                                   trainer.accumulate_grad_batches)
        if self.expert_load is not None:
            loss = loss + self._router_terms(outputs)
        return loss

    def summary(self) -> dict[str, Any]:
        """A mixture of experts' tokens per expert over the run, summed over the ranks, and each layer's load imbalance
        (largest over mean), for results.jsonl; empty for a dense model. Every rank calls it: it all-reduces."""
        totals = None if self.expert_load is None else self.expert_load.run_totals()
        if totals is None:
            return {}
        return {"moe_tokens_per_expert": totals.long().tolist(), "moe_imbalance": router.imbalance(totals).tolist()}

    def _router_terms(self, outputs: Any) -> torch.Tensor | float:
        """Log a mixture of experts' auxiliary loss and each layer's load imbalance; what the model adds to the loss
        (a micro-batch's mean, as the language-model loss: Lightning and the ranks' average make it the step's)."""
        self.expert_load.observe(outputs.router_logits)
        # Rank 0's micro-batch (an all-reduce per figure and step would cost more than it tells); the run's counts,
        # summed over the ranks, are in results.jsonl.
        self.log("train/aux_loss", outputs.aux_loss.detach(), sync_dist=False)
        for layer, value in enumerate(router.imbalance(self.expert_load.last)):
            self.log(f"moe/imbalance_layer_{layer}", value.float(), sync_dist=False)
        trained = router.trained_aux_loss(self.model.config, outputs.aux_loss)
        return 0.0 if trained is None else trained

    def _seed_dropout(self) -> None:
        """Key LoRA's dropout masks by the run's seed, the optimizer step, the micro-batch within it and the rank: all
        restored by a resume (which starts at a step's first micro-batch), so it draws the uninterrupted run's masks."""
        step = self.trainer.global_step
        micro = self._dropout_key[1] + 1 if self._dropout_key[0] == step else 0
        self._dropout_key = (step, micro)
        lora_adapters.seed_dropout(self.model, self._init_seed, step, micro, self.trainer.global_rank)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch)[0], weight=target_count(batch["labels"]))

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        # compute() already reduced across ranks; sync_dist only silences Lightning's warning.
        self.log_dict({"val/loss": loss, "val/ppl": torch.exp(loss)}, prog_bar=True, sync_dist=True)

    # --- optimisation ----------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [group for group in groups if group["params"]]  # LoRA: every adapter is a matrix
        adamw = {"lr": hp.learning_rate, "betas": tuple(hp.betas)}
        # A strategy whose gradient compression needs its own optimizer (1-bit Adam) builds it from AdamW's arguments.
        replacement = getattr(self.trainer.strategy, "replacement_optimizer", None)
        optimizer = (replacement and replacement(groups, **adamw)) or torch.optim.AdamW(groups, **adamw)
        # max_steps avoids estimated_stepping_batches, which would build the train loader before a resume.
        total = hp.schedule_steps or (self.trainer.max_steps if self.trainer.max_steps > 0
                                      else self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, int(total), hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"--trainer.gradient_clip_algorithm {gradient_clip_algorithm} is not supported; use norm")
        # The strategy knows where the gradients are (sharded on the devices, or on the host with SlideFSDP):
        # it computes their global norm, clips, and stops or skips a non-finite step.
        strategy = self.trainer.strategy
        norm = strategy.clip_and_guard(optimizer, gradient_clip_val)
        if norm is not None:
            self.log("train/grad_norm", norm, sync_dist=False)
        # Logged when it changes: self.log makes a device tensor of a Python number, a blocking host-to-device copy
        # (a host sync per step, which callbacks.HostSyncs counts).
        if strategy.nonfinite_steps != self._logged_nonfinite_steps:
            self._logged_nonfinite_steps = strategy.nonfinite_steps
            self.log("train/nonfinite_steps", float(strategy.nonfinite_steps), sync_dist=False)

    # --- checkpoints -----------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Enough to rebuild the network without this code's defaults, read its text and evaluate it as it was
        # trained: used by `lit_fsdp export`, `generate` and `evaluate`.
        checkpoint["hf_config"] = self.model.config.to_dict()
        if self._base_record is not None:  # what trains only: the base it needs, for resume and export
            checkpoint["lora"] = self._base_record
        datamodule = getattr(self._trainer, "datamodule", None)
        tokenizer = getattr(datamodule, "tokenizer", None)
        # The tokenizer itself, not its folder: the checkpoint finds it on any machine (older ones hold a "tokenizer_path").
        checkpoint["tokenizer_files"] = None if tokenizer is None else tokenizer_files(tokenizer)
        checkpoint["seq_len"] = getattr(datamodule, "seq_len", None)
        # The chat template a fine-tune's samples were rendered with (None: plain text), for generate's prompts.
        checkpoint["chat_template"] = getattr(datamodule, "chat_template", None)
        reopen_cut_epoch(checkpoint, self._trainer)


# transformers' configs that dequantize a checkpoint while loading it, by quant_method.
_DEQUANTIZE = {"mxfp4": "Mxfp4Config(dequantize=True)", "fp8": "FineGrainedFP8Config(dequantize=True)"}


def pretrained_config(path: str, folder: str | None = None) -> PretrainedConfig:
    """The Hugging Face config of the model ``--model.pretrained_path`` names (``path``; ``folder``, where it was
    resolved to, default ``path``), or a one-line error saying what is wrong. A repository's own code is never run."""
    folder = path if folder is None else folder
    file = Path(folder) / "config.json"
    if not Path(folder).expanduser().exists():
        raise FileNotFoundError(f"--model.pretrained_path {path}: no such folder {Path(folder).expanduser().absolute()} "
                                "(a relative path is read from the current folder); check the path, or make it first "
                                "with python -m lit_fsdp export CHECKPOINT FOLDER (docs/finetuning.md)")
    if not file.is_file():
        raise FileNotFoundError(f"--model.pretrained_path {path} has no config.json; give a folder written by save_pretrained "
                                "or by python -m lit_fsdp export CHECKPOINT FOLDER (docs/finetuning.md makes one), or a "
                                "Hub name owner/name")
    try:
        fields = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise OneLineError(f"--model.pretrained_path {path}: {file} is not valid JSON ({error}), e.g. cut short by a "
                           "copy; copy the folder again or write it with save_pretrained") from error
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        # transformers would ask for trust_remote_code (or prompt on a terminal, where it is left unset)
        raise OneLineError(f"--model.pretrained_path {path}: model_type {model_type!r} is unknown to transformers "
                           f"{transformers.__version__}, and lit_fsdp does not run a repository's own code "
                           "(trust_remote_code stays off); give a model of a type transformers knows, or install a "
                           "transformers that knows it")
    quantization = fields.get("quantization_config") if isinstance(fields, dict) else None
    if isinstance(quantization, dict):  # gpt-oss's MXFP4 experts, a GPTQ or FP8 checkpoint: not trainable weights
        method = quantization.get("quant_method", "quantized")
        raise OneLineError(f"--model.pretrained_path {path} holds {method} weights (config.json's quantization_config), "
                           "which lit_fsdp does not train; dequantize it first, e.g. AutoModelForCausalLM.from_pretrained("
                           f"path, quantization_config={_DEQUANTIZE.get(method, 'its config')}, dtype=torch.bfloat16)"
                           ".save_pretrained(FOLDER), and give that FOLDER")
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise OneLineError(f"--model.pretrained_path {path}: {file} is not a Hugging Face config ({_first_line(error)}); "
                           "give a folder written by save_pretrained") from error


def check_overrides(config: PretrainedConfig, overrides: dict[str, Any] | None) -> None:
    """Refuse a ``--model.config_overrides`` value of another type than ``config``'s own for that field: transformers
    4.x takes ``{n_layer: six}`` and fails while building the network; a float where an int belongs fails in torch."""
    for key, value in (overrides or {}).items():
        default = getattr(config, key, None)
        if isinstance(default, bool):
            expected = (bool,)
        elif isinstance(default, int):
            expected = (int,)
        elif isinstance(default, float):
            expected = (int, float)
        elif isinstance(default, str):
            expected = (str,)
        else:  # unset, a list or a dict: left to the config's own checks
            continue
        if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
            raise OneLineError(
                f"--model.config_overrides {key}={value!r}: the {config.model_type} config's {key} takes "
                f"{type(default).__name__} values, not {type(value).__name__}; give e.g. {{{key}: {json.dumps(default)}}}"
            )


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else type(error).__name__)


def follow_learning_rate(scheduler: torch.optim.lr_scheduler.LambdaLR, peak: float) -> float | None:
    """Make ``peak`` the scheduler's base learning rate, and its groups' current rate the schedule's at its step;
    the base it had if that differed (a checkpoint of another learning rate was resumed), else None."""
    if all(base == peak for base in scheduler.base_lrs):
        return None
    previous = scheduler.base_lrs[0]
    scheduler.base_lrs = [peak] * len(scheduler.base_lrs)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = peak, peak * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return previous


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
