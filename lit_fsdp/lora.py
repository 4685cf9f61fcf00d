"""LoRA: low-rank adapters trained on a frozen base model, without renaming any of the base's parameters.

Each target linear module (``nn.Linear``, or GPT-2's ``Conv1D`` whose weight is in x out) gets two float32
parameters of its own, ``lora_A`` (rank x in) and ``lora_B`` (out x rank), peft's shapes for both kinds, and a
forward hook that adds ``dropout(x) @ A.T @ B.T * alpha / rank`` to its output. The base's state-dict keys stay
those of the plain model, so meta-device building, initialisation by unit, pretrained loading and FSDP2's units
work as without adapters; the adapters are ``<module>.lora_A`` and ``<module>.lora_B`` beside ``<module>.weight``.
peft wraps the module instead, moving its weight to ``<module>.base_layer.weight``.

A is initialised as peft does (Kaiming-uniform, a = sqrt(5)) and B with zeros, so a model starts as its base.
Each module's A is drawn from a generator seeded with the run's seed and the module's name: the same on every
rank and world size. Checkpoints of a LoRA run hold only the adapters; what they record of the base
(``base_record``) must match the base a resume or an export rebuilds (``check_same_base``).
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.pytorch_utils import Conv1D

from lit_fsdp.errors import OneLineError, RunError
from lit_fsdp.weights import clean_name, write_shard

#: Targets when ``--model.lora`` names none: every linear layer of the attention and the MLP.
DEFAULT_TARGETS: dict[str, list[str]] = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
ADAPTERS = ("lora_A", "lora_B")
# Config fields that do not describe the base's weights: left out of its fingerprint.
_NOT_THE_BASE = ("transformers_version", "use_cache", "dtype", "torch_dtype", "architectures")


@dataclass
class LoraConfig:
    """Low-rank adapters on a frozen base (``--model.lora '{rank: 16, alpha: 32}'``)."""

    rank: int = 16
    """Rank of each adapter: A is rank x in, B is out x rank."""
    alpha: float = 32.0
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    targets: list[str] | None = None
    """Linear modules to adapt, by name or name suffix (``q_proj``, ``attn.c_proj``); default: every linear layer of
    attention and MLP (GPT-2: c_attn, c_proj, c_fc; Llama: q/k/v/o_proj, gate/up/down_proj)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1 or not self.alpha > 0 or not 0 <= self.dropout < 1:
            raise OneLineError(f"--model.lora rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}: give an "
                               "integer rank >= 1, alpha > 0 and dropout in [0, 1)")
        if self.targets is not None and (isinstance(self.targets, str) or not self.targets):
            raise OneLineError(f"--model.lora targets={self.targets!r}: give a list of module names, e.g. [q_proj, v_proj], "
                               "or leave it out for the architecture's defaults")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def as_config(value: LoraConfig | dict[str, Any] | None) -> LoraConfig | None:
    """``--model.lora`` as a ``LoraConfig`` (a checkpoint's hyperparameters hold it as a plain dict)."""
    return LoraConfig(**value) if isinstance(value, dict) else value


# --- which modules -------------------------------------------------------------------------------


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every ``nn.Linear`` and ``Conv1D`` of ``model`` by path, but the LM head (tied to the embeddings, often)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {clean_name(name): module for name, module in model.named_modules()
            if isinstance(module, (nn.Linear, Conv1D)) and module is not head}


def target_paths(model: nn.Module, config: LoraConfig) -> list[str]:
    """The paths of the modules ``config`` adapts in ``model``; an unknown name is refused in one line."""
    linear = linear_modules(model)
    kinds = sorted({path.rpartition(".")[2] for path in linear})
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    targets = config.targets
    if targets is None:
        if model_type not in DEFAULT_TARGETS:
            raise OneLineError(f"--model.lora: no default targets for {model_type} models; name them with "
                               f"--model.lora.targets, from this model's linear modules {kinds}")
        targets = DEFAULT_TARGETS[model_type]
    paths = {target: [p for p in linear if p == target or p.endswith(f".{target}")] for target in targets}
    unknown = [target for target, found in paths.items() if not found]
    if unknown:
        raise OneLineError(f"--model.lora targets {unknown} name no linear module of this {model_type} model; "
                           f"choose from {kinds}")
    return sorted({p for found in paths.values() for p in found}, key=list(linear).index)


def adapter_parameters(model: nn.Module | PretrainedConfig, lora: LoraConfig | dict[str, Any] | None) -> int:
    """How many parameters ``attach`` adds to ``model`` (a config is built on the meta device): rank x (in + out) per
    target module, A and B; 0 without ``lora``. What a LoRA run trains, and all its gradients and AdamW state hold."""
    lora = as_config(lora)
    if lora is None:
        return 0
    if isinstance(model, PretrainedConfig):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model)
    # in + out whichever way the weight is stored (Linear: out x in, Conv1D: in x out)
    return sum(lora.rank * sum(model.get_submodule(path).weight.shape) for path in target_paths(model, lora))


# --- adapters on a module ------------------------------------------------------------------------


def attach(model: nn.Module, config: LoraConfig, device: torch.device | str | None = None) -> list[str]:
    """Freeze every parameter of ``model``, give each target module its adapters (on ``device``, default that of its
    weight: the meta device before sharding) and the forward that adds them; returns the adapted modules' paths."""
    paths = target_paths(model, config)
    for param in model.parameters():
        param.requires_grad_(False)
    for path in paths:
        module = model.get_submodule(path)
        weight = module.weight
        fan_in, fan_out = (weight.shape[0], weight.shape[1]) if isinstance(module, Conv1D) else (weight.shape[1], weight.shape[0])
        module.lora_A = nn.Parameter(torch.empty(config.rank, fan_in, device=device or weight.device, dtype=torch.float32))
        module.lora_B = nn.Parameter(torch.empty(fan_out, config.rank, device=device or weight.device, dtype=torch.float32))
        module.lora_scale, module.lora_dropout = config.scale, config.dropout
        module.lora_hook = module.register_forward_hook(_add_adapters)
    return paths


def _add_adapters(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    """``output + dropout(x) @ A.T @ B.T * scale``: peft's LoRA forward, computed in the adapters' dtype (FSDP2's
    ``param_dtype`` once sharded)."""
    a, b = module.lora_A, module.lora_B
    x = F.dropout(args[0], module.lora_dropout, module.training) if module.lora_dropout else args[0]
    return output + (F.linear(F.linear(x.to(a.dtype), a), b) * module.lora_scale).to(output.dtype)


def adapted(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that carry adapters, by clean path, in model order."""
    return [(clean_name(name), module) for name, module in model.named_modules() if hasattr(module, "lora_hook")]


def adapter_names(model: nn.Module) -> set[str]:
    """The clean parameter names of every adapter: what a Hugging Face base folder does not hold."""
    return {f"{path}.{name}" for path, _ in adapted(model) for name in ADAPTERS}


def init_adapters(model: nn.Module, seed: int) -> None:
    """A Kaiming-uniform (a = sqrt(5), as peft), B zeros; each module's A from ``seed`` and its name, written to this
    rank's shard: the same adapters for every world size."""
    with torch.no_grad():
        for path, module in adapted(model):
            generator = torch.Generator().manual_seed(seed + zlib.crc32(f"{path}.lora_A".encode()))
            a = torch.empty(module.lora_A.shape)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            write_shard(module.lora_A, a)
            write_shard(module.lora_B, torch.zeros(module.lora_B.shape))


def merge(model: nn.Module) -> None:
    """Fold each module's adapters into its weight (``W + B @ A * scale``; transposed for Conv1D) and remove them:
    ``model`` is then the plain architecture, as ``transformers`` builds it."""
    with torch.no_grad():
        for _, module in adapted(model):
            delta = (module.lora_B.float() @ module.lora_A.float()) * module.lora_scale
            module.weight += (delta.t() if isinstance(module, Conv1D) else delta).to(module.weight.dtype)
            module.lora_hook.remove()
            for name in (*ADAPTERS, "lora_hook", "lora_scale", "lora_dropout"):
                delattr(module, name)
    model.requires_grad_(True)


# --- peft's adapter format -----------------------------------------------------------------------


def peft_adapter(model: nn.Module, config: LoraConfig, base: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``adapter_config.json`` and the tensors of ``adapter_model.safetensors`` as peft writes them for ``model``."""
    modules = adapted(model)
    tensors = {f"base_model.model.{path}.{name}.weight": getattr(module, name).detach().float().contiguous()
               for path, module in modules for name in ADAPTERS}
    targets = config.targets or DEFAULT_TARGETS[model.config.model_type]
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout, "target_modules": targets,
        "bias": "none", "fan_in_fan_out": any(isinstance(m, Conv1D) for _, m in modules),  # Conv1D's weight is in x out
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
    return adapter_config, tensors


# --- the base an adapter checkpoint belongs to ---------------------------------------------------


def _checksum(param: torch.Tensor) -> float:
    """The float64 sum of a parameter's values, over every rank's shard (a collective for a DTensor)."""
    if isinstance(param, DTensor):
        return float(torch.sum(param.detach(), dtype=torch.float64).full_tensor())
    return float(torch.sum(param.detach(), dtype=torch.float64))


def base_record(model: nn.Module, config: LoraConfig, base: str, seed: int) -> dict[str, Any]:
    """What an adapter checkpoint keeps of its base (``base``: the pretrained folder, or ``preset NAME``): its config's
    hash and the sums of a few weights, beside the adapters' settings. Every rank must call it (the sums are
    collectives)."""
    fields = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k not in _NOT_THE_BASE}
    modules = adapted(model)
    weights = {"embeddings": model.get_input_embeddings().weight, modules[0][0]: modules[0][1].weight,
               modules[-1][0]: modules[-1][1].weight}
    return {
        "lora": asdict(config), "base": base, "init_seed": seed,
        "config_sha256": hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest(),
        "weight_sums": {name: _checksum(param) for name, param in weights.items()},
    }


def check_same_base(saved: dict[str, Any], current: dict[str, Any], checkpoint: Any, fix: str | None = None) -> None:
    """Refuse in one line adapters whose checkpoint recorded another base, or other adapter settings, than ``current``
    (``base_record``s); ``fix`` says what to do (default: for a resumed run)."""
    if fix is None:
        fix = f"resume it on the base it was trained on, {saved['base']}, with --model.lora '{json.dumps(saved['lora'])}'"
        if saved["base"].startswith("preset "):  # a preset's random weights are drawn from the run's seed
            fix += f" and --seed_everything {saved['init_seed']}"
    if saved["lora"] != current["lora"]:
        raise RunError(f"checkpoint {checkpoint} holds LoRA adapters {json.dumps(saved['lora'])}, but this run's "
                       f"--model.lora is {json.dumps(current['lora'])}; {fix}")
    if saved["config_sha256"] != current["config_sha256"]:
        raise RunError(f"checkpoint {checkpoint} holds LoRA adapters for another model config than this run's "
                       f"({current['base']}); {fix}")
    for name, total in saved["weight_sums"].items():
        now = current["weight_sums"].get(name)
        if now is None or not math.isclose(total, now, rel_tol=1e-9, abs_tol=1e-9):
            raise RunError(f"checkpoint {checkpoint} holds LoRA adapters trained on another base: the {name} weights "
                           f"of {current['base']} sum to {now}, the checkpoint's base's to {total}; {fix}")
