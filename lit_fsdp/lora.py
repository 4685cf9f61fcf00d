"""LoRA: low-rank adapters trained on a frozen base model, without renaming any of the base's parameters.

Each target linear module (``nn.Linear``, or GPT-2's ``Conv1D`` whose weight is in x out) gets two float32
parameters of its own, ``lora_A`` (rank x in) and ``lora_B`` (out x rank), peft's shapes for both kinds, and a
forward hook that adds ``dropout(x) @ A.T @ B.T * alpha / rank`` to its output. The base's state-dict keys stay
those of the plain model, so meta-device building, initialisation by unit, pretrained loading and FSDP2's units
work as without adapters; the adapters are ``<module>.lora_A`` and ``<module>.lora_B`` beside ``<module>.weight``.
peft wraps the module instead, moving its weight to ``<module>.base_layer.weight``. Modules named in ``train``
(peft's ``modules_to_save``) stay trainable whole, in place, under their own names.

A mixture of experts' fused expert tensors (``mlp.experts.gate_up_proj``: experts x out x in, on a module that is
not a linear layer) are adapted as peft's ``target_parameters`` adapts them: ``lit_fsdp.lora_parameters``, with
adapters ``<module>.<parameter>_lora_A`` and ``_lora_B`` beside the parameter.

A is initialised as peft does (Kaiming-uniform, a = sqrt(5)) and B with zeros, so a model starts as its base.
Each module's A is drawn from a generator seeded with the run's seed and the module's name: the same on every
rank and world size. Dropout masks are drawn the same way, from the key ``seed_dropout`` sets (the run's seed,
the step, the micro-batch and the rank), so a resumed run draws the uninterrupted run's masks. Checkpoints of a
LoRA run hold only what trains; what they record of the base (``base_record``) must match the base a resume or an
export rebuilds (``check_same_base``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.pytorch_utils import Conv1D

from lit_fsdp import lora_parameters
from lit_fsdp.errors import OneLineError, RunError
from lit_fsdp.weights import clean_name, write_shard

#: Mixture-of-experts families whose experts are fused 3D tensors (transformers 5) of the same names.
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
#: Targets when ``--model.lora`` names none: every linear layer of the attention and the MLP. The Llama-like families
#: share Llama's module names; Phi-3 fuses Q, K, V (qkv_proj) and gate and up (gate_up_proj). A mixture of experts:
#: its attention's (its experts: ``DEFAULT_TARGET_PARAMETERS``; Qwen2-MoE's linear shared expert only if named).
DEFAULT_TARGETS: dict[str, list[str]] = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    **{family: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
       for family in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "olmo2")},
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    **{family: ["q_proj", "k_proj", "v_proj", "o_proj"] for family in MOE_FAMILIES},
}
#: ``target_parameters`` when ``--model.lora`` names none: a mixture of experts' expert tensors; its router
#: (``mlp.gate``) is left as it is.
DEFAULT_TARGET_PARAMETERS: dict[str, list[str]] = {
    family: ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] for family in MOE_FAMILIES}
ADAPTERS = ("lora_A", "lora_B")
#: Words ``train`` accepts beside module names, and the modules they name.
SHORTCUTS = {"embeddings": "every nn.Embedding", "norms": "every normalisation layer (a class named *Norm)"}
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
    attention and MLP (GPT-2: c_attn, c_proj, c_fc; Llama-like: q/k/v/o_proj, gate/up/down_proj; Phi-3: qkv_proj,
    o_proj, gate_up_proj, down_proj; mixtures of experts: q/k/v/o_proj)."""
    target_parameters: list[str] | None = None
    """Parameters of modules that are not linear layers to adapt, by name or name suffix, as peft's
    ``target_parameters`` (``mlp.experts.gate_up_proj``); default: a mixture of experts' expert tensors
    (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), none elsewhere; ``[]``: none. They take no dropout."""
    train: list[str] | None = None
    """Whole modules of the base trained beside the adapters, as peft's modules_to_save: by name or name suffix
    (``[wte, wpe, ln_f]``, ``[embed_tokens, norm]``) or ``embeddings`` (every nn.Embedding) and ``norms`` (every
    normalisation layer); a head tied to the embeddings trains with them."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1 or not self.alpha > 0 or not 0 <= self.dropout < 1:
            raise OneLineError(f"--model.lora rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}: give an "
                               "integer rank >= 1, alpha > 0 and dropout in [0, 1)")
        if self.targets is not None and (isinstance(self.targets, str) or not self.targets):
            raise OneLineError(f"--model.lora targets={self.targets!r}: give a list of module names, e.g. [q_proj, v_proj], "
                               "or leave it out for the architecture's defaults")
        if self.target_parameters is not None and isinstance(self.target_parameters, str):
            raise OneLineError(f"--model.lora target_parameters={self.target_parameters!r}: give a list of parameter "
                               "names, e.g. [mlp.experts.gate_up_proj], [] for none, or leave it out for the defaults")
        if self.train is not None and (isinstance(self.train, str) or not self.train):
            raise OneLineError(f"--model.lora train={self.train!r}: give a list of module names, e.g. [embeddings, norms] "
                               "or [wte, ln_f], or leave it out to train the adapters only")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def as_config(value: LoraConfig | dict[str, Any] | None) -> LoraConfig | None:
    """``--model.lora`` as a ``LoraConfig`` (a checkpoint's hyperparameters hold it as a plain dict, perhaps without
    the fields added since)."""
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
    model_type = _model_type(model)
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


def _model_type(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def parameter_candidates(model: nn.Module) -> list[str]:
    """The clean paths of the parameters ``target_parameters`` may name, in model order: the 2D and 3D parameters of
    modules that are not linear layers or embeddings (a mixture of experts' expert tensors and router), not adapters."""
    adapters = set(lora_parameters.named_adapters(model))
    paths = [clean_name(f"{path}.{name}" if path else name) for path, module in model.named_modules()
             if not isinstance(module, (nn.Linear, Conv1D, nn.Embedding))
             for name, param in module.named_parameters(recurse=False) if param.dim() in (2, 3)]
    return [path for path in paths if path not in adapters]


def target_parameter_paths(model: nn.Module, config: LoraConfig) -> list[str]:
    """The paths of the parameters ``config`` adapts in ``model`` (peft's ``target_parameters``, matched as peft
    matches them: the path or a dotted suffix of it); an unknown name, or dropout beside them, is refused in one
    line."""
    candidates = parameter_candidates(model)
    model_type = _model_type(model)
    names = target_parameter_names(model_type, config)
    found = {name: [p for p in candidates if p == name or p.endswith(f".{name}")] for name in names}
    unknown = [name for name, paths in found.items() if not paths]
    if unknown:
        kinds = sorted({re.sub(r"^.*?\.\d+\.", "", path) for path in candidates})  # without the layer's prefix
        choose = (f"choose from {kinds}" if kinds
                  else "it has none (no fused expert tensors): adapt its linear modules with targets")
        raise OneLineError(f"--model.lora target_parameters {unknown} name no parameter of this {model_type} model "
                           f"outside its linear modules; {choose}")
    paths = sorted({p for found_paths in found.values() for p in found_paths}, key=candidates.index)
    if paths and config.dropout:
        raise OneLineError(f"--model.lora dropout={config.dropout} with adapters on {model_type}'s parameters "
                           f"{names}: those adapt a weight, not an input, and take no dropout (nor does peft); set "
                           "dropout 0, or target_parameters [] to adapt the linear modules alone")
    return paths


def target_parameter_names(model_type: str, config: LoraConfig) -> list[str]:
    """``config.target_parameters``, or the defaults of ``model_type`` (``DEFAULT_TARGET_PARAMETERS``, else none)."""
    names = config.target_parameters
    return DEFAULT_TARGET_PARAMETERS.get(model_type, []) if names is None else names


def _adapted_modules(paths: list[str], parameters: list[str]) -> list[str]:
    """The paths of the adapted modules: the linear ones (``paths``) and the owners of the adapted ``parameters``."""
    return [*paths, *dict.fromkeys(path.rpartition(".")[0] for path in parameters)]


def _names_module(name: str, path: str, module: nn.Module) -> bool:
    if name == "embeddings":
        return isinstance(module, nn.Embedding)
    if name == "norms":
        return type(module).__name__.endswith("Norm")
    return path == name or path.endswith(f".{name}")


def train_paths(model: nn.Module, config: LoraConfig, targets: list[str] | None = None) -> list[str]:
    """The paths of the modules ``config.train`` names, trained whole beside the adapters (``targets``: the adapted
    modules' paths, default those of ``config``); a head tied to the input embeddings is named by the embeddings'
    path. A name that matches no module, or a module that is or holds an adapted one, is refused in one line."""
    if not config.train:
        return []
    if targets is None:
        targets = _adapted_modules(target_paths(model, config), target_parameter_paths(model, config))
    modules = {clean_name(name): module for name, module in model.named_modules()
               if name and next(module.parameters(), None) is not None}
    found = {name: [p for p, m in modules.items() if _names_module(name, p, m)] for name in config.train}
    unknown = [name for name, paths in found.items() if not paths]
    if unknown:
        owners = sorted({p.rpartition(".")[2] for p, m in modules.items()
                         if next(m.parameters(recurse=False), None) is not None and p not in targets})
        raise OneLineError(f"--model.lora train {unknown} name no module of this {model.config.model_type} model; "
                           f"choose from {list(SHORTCUTS)} or {owners}")
    chosen = [p for p in modules if any(p in paths for paths in found.values())]
    adapted_too = [p for p in chosen if any(t == p or t.startswith(f"{p}.") for t in targets)]
    if adapted_too:
        raise OneLineError(f"--model.lora train {config.train} names {adapted_too[:3]}, which are or hold adapted "
                           "modules; a module is adapted or trained whole: remove it from train or from targets")
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is embeddings.weight:  # tied: one parameter, trained once
        names = {module: path for path, module in modules.items()}
        chosen = [names[embeddings] if modules[p] is head else p for p in chosen]
    chosen = list(dict.fromkeys(chosen))
    return [p for p in chosen if not any(p.startswith(f"{outer}.") for outer in chosen)]


def _on_meta(model: nn.Module | PretrainedConfig) -> nn.Module:
    if isinstance(model, PretrainedConfig):
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model)
    return model


def adapter_parameters(model: nn.Module | PretrainedConfig, lora: LoraConfig | dict[str, Any] | None) -> int:
    """How many parameters ``attach`` adds to ``model`` (a config is built on the meta device): rank x (in + out) per
    target module, A and B, and rank x experts x (in + out) per target parameter; 0 without ``lora``."""
    lora = as_config(lora)
    if lora is None:
        return 0
    model = _on_meta(model)
    # in + out whichever way the weight is stored (Linear: out x in, Conv1D: in x out)
    linear = sum(lora.rank * sum(model.get_submodule(path).weight.shape) for path in target_paths(model, lora))
    shapes = [lora_parameters.adapter_shapes(model.get_parameter(path), model.get_submodule(path.rpartition(".")[0]),
                                             lora.rank) for path in target_parameter_paths(model, lora)]
    return linear + sum(math.prod(a) + math.prod(b) for a, b in shapes)


def trained_parameters(model: nn.Module | PretrainedConfig, lora: LoraConfig | dict[str, Any] | None) -> int:
    """What a LoRA run trains, and all its gradients, AdamW state and checkpoints hold: the adapters and the modules
    of ``train`` (a tied head once); 0 without ``lora``."""
    lora = as_config(lora)
    if lora is None:
        return 0
    model = _on_meta(model)
    whole = {id(p): p for path in train_paths(model, lora) for p in model.get_submodule(path).parameters()}
    return adapter_parameters(model, lora) + sum(p.numel() for p in whole.values())


def trained_matrices(model: nn.Module | PretrainedConfig, lora: LoraConfig | dict[str, Any] | None) -> int:
    """The weights of the base's matrices (linear layers, the LM head, expert and router tensors) that get a weight
    gradient: those ``train`` trains, and the expert tensors of ``target_parameters``, whose adapted weight's gradient
    ``grouped_mm`` computes before it reaches A and B. Each costs a weight gradient more than a frozen one
    (``lit_fsdp.flops``); embedding lookups and norms cost none. An expert tensor counts all its experts, of which a
    token computes only the ones it is routed to."""
    lora = as_config(lora)
    if lora is None:
        return 0
    model = _on_meta(model)
    trained = {id(p) for path in train_paths(model, lora) for p in model.get_submodule(path).parameters()}
    trained |= {id(model.get_parameter(path)) for path in target_parameter_paths(model, lora)}
    matrices = {id(m.weight): m.weight for m in model.modules() if isinstance(m, (nn.Linear, Conv1D))}
    matrices |= {id(p): p for p in map(model.get_parameter, parameter_candidates(model))}
    return sum(p.numel() for key, p in matrices.items() if key in trained)


# --- adapters on a module ------------------------------------------------------------------------


def attach(model: nn.Module, config: LoraConfig, device: torch.device | str | None = None) -> list[str]:
    """Freeze every parameter of ``model`` but those of the ``train`` modules, give each target module and target
    parameter its adapters (on ``device``, default that of its weight: the meta device before sharding) and the
    forward that adds them; returns the adapted modules' and parameters' paths."""
    paths, parameters = target_paths(model, config), target_parameter_paths(model, config)
    whole = train_paths(model, config, _adapted_modules(paths, parameters))
    for param in model.parameters():
        param.requires_grad_(False)
    for path in whole:
        model.get_submodule(path).requires_grad_(True)
    for path in paths:
        module = model.get_submodule(path)
        weight = module.weight
        fan_in, fan_out = (weight.shape[0], weight.shape[1]) if isinstance(module, Conv1D) else (weight.shape[1], weight.shape[0])
        module.lora_A = nn.Parameter(torch.empty(config.rank, fan_in, device=device or weight.device, dtype=torch.float32))
        module.lora_B = nn.Parameter(torch.empty(fan_out, config.rank, device=device or weight.device, dtype=torch.float32))
        module.lora_scale, module.lora_dropout = config.scale, config.dropout
        module.lora_path, module.lora_seed = path, None
        module.lora_hook = module.register_forward_hook(_add_adapters)
    for path in parameters:
        owner, _, name = path.rpartition(".")
        lora_parameters.attach(model.get_submodule(owner), name, path, config.rank, config.scale, device)
    return [*paths, *parameters]


def _add_adapters(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    """``output + dropout(x) @ A.T @ B.T * scale``: peft's LoRA forward, computed in the adapters' dtype (FSDP2's
    ``param_dtype`` once sharded)."""
    a, b = module.lora_A, module.lora_B
    x = _dropout(module, args[0]) if module.lora_dropout and module.training else args[0]
    return output + (F.linear(F.linear(x.to(a.dtype), a), b) * module.lora_scale).to(output.dtype)


@torch.compiler.disable  # a seed that changes every step would recompile a compiled block each step
def _dropout(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Dropout with the mask drawn from ``module.lora_seed`` (``seed_dropout``): the same mask for the same key, so a
    resumed run and an activation checkpoint's recompute draw the masks of the first pass; without a key, torch's."""
    if module.lora_seed is None:
        return F.dropout(x, module.lora_dropout, True)
    generator = torch.Generator(device=x.device).manual_seed(module.lora_seed)
    keep = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1 - module.lora_dropout, generator=generator)
    return x * keep / (1 - module.lora_dropout)  # autograd keeps the one-byte mask


def seed_dropout(model: nn.Module, *key: int) -> None:
    """Key every adapter's next dropout masks with ``key`` (the run's seed, the step, the micro-batch, the rank) and the
    module's path: masks that depend on nothing a checkpoint does not restore."""
    for _, module in adapted(model):
        digest = hashlib.blake2b(repr((*key, module.lora_path)).encode(), digest_size=8).digest()
        module.lora_seed = int.from_bytes(digest, "little") >> 1  # manual_seed takes up to 2**63 - 1


def adapted(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The linear modules that carry adapters, by clean path, in model order (the adapted parameters:
    ``lora_parameters.adapted``)."""
    return [(clean_name(name), module) for name, module in model.named_modules() if hasattr(module, "lora_hook")]


def adapter_names(model: nn.Module) -> set[str]:
    """The clean parameter names of every adapter: what a Hugging Face base folder does not hold."""
    linear = {f"{path}.{name}" for path, _ in adapted(model) for name in ADAPTERS}
    return linear | set(lora_parameters.named_adapters(model))


def trained_names(model: nn.Module) -> set[str]:
    """The clean names of the parameters a LoRA model trains (a tied one under its first name): what its checkpoints
    hold."""
    return {clean_name(name) for name, param in model.named_parameters() if param.requires_grad}


def init_adapters(model: nn.Module, seed: int) -> None:
    """A Kaiming-uniform (a = sqrt(5), as peft), B zeros; each A from ``seed`` and its name, written to this rank's
    shard: the same adapters for every world size."""
    pairs = [(f"{path}.lora_A", module.lora_A, module.lora_B) for path, module in adapted(model)]
    pairs += [(f"{path.rpartition('.')[0]}.{name}_lora_A", *lora_parameters.adapters(module, name))
              for path, module, name in lora_parameters.adapted(model)]
    with torch.no_grad():
        for name, lora_a, lora_b in pairs:
            generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
            a = torch.empty(lora_a.shape)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            write_shard(lora_a, a)
            write_shard(lora_b, torch.zeros(lora_b.shape))


def merge(model: nn.Module) -> None:
    """Fold each module's adapters into its weight (``W + B @ A * scale``; transposed for Conv1D), and each adapted
    parameter's into it, and remove them: ``model`` is then the plain architecture, as ``transformers`` builds it."""
    with torch.no_grad():
        for _, module in adapted(model):
            delta = (module.lora_B.float() @ module.lora_A.float()) * module.lora_scale
            module.weight += (delta.t() if isinstance(module, Conv1D) else delta).to(module.weight.dtype)
            module.lora_hook.remove()
            for name in (*ADAPTERS, "lora_hook", "lora_scale", "lora_dropout", "lora_path", "lora_seed"):
                delattr(module, name)
    lora_parameters.merge(model)
    model.requires_grad_(True)


# --- peft's adapter format -----------------------------------------------------------------------


def peft_adapter(model: nn.Module, config: LoraConfig, base: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``adapter_config.json`` and the tensors of ``adapter_model.safetensors`` as peft writes them for ``model``."""
    modules = adapted(model)
    tensors = {f"base_model.model.{path}.{name}.weight": getattr(module, name).detach().float().contiguous()
               for path, module in modules for name in ADAPTERS}
    peft_names = lora_parameters.peft_names(model)
    tensors |= {peft_names[name]: param.detach().float().contiguous()
                for name, param in lora_parameters.named_adapters(model).items()}
    adapted_parameters = [path for path, _, _ in lora_parameters.adapted(model)]
    whole = train_paths(model, config, _adapted_modules([path for path, _ in modules], adapted_parameters))
    for path in whole:  # peft's keys for modules_to_save: the module's own, without "modules_to_save.default"
        for name, param in model.get_submodule(path).named_parameters():
            tensors[f"base_model.model.{path}.{name}"] = param.detach().float().contiguous()
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    tie = head is not None and head.weight is embeddings.weight and any(model.get_submodule(p) is embeddings for p in whole)
    if tie:  # peft (ensure_weight_tying) saves the tied head too, under its own name
        names = {module: clean_name(name) for name, module in model.named_modules()}
        tensors[f"base_model.model.{names[head]}.weight"] = tensors[f"base_model.model.{names[embeddings]}.weight"].clone()
    targets = config.targets or DEFAULT_TARGETS[model.config.model_type]
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout, "target_modules": targets,
        "target_parameters": target_parameter_names(model.config.model_type, config) or None,
        "bias": "none", "fan_in_fan_out": any(isinstance(m, Conv1D) for _, m in modules),  # Conv1D's weight is in x out
        "init_lora_weights": True, "inference_mode": True,
        # full paths: peft matches modules_to_save by suffix, and "h.1.ln_1" would also match "h.11.ln_1"
        "modules_to_save": whole or None, "ensure_weight_tying": tie,
    }
    return adapter_config, tensors


# --- the base an adapter checkpoint belongs to ---------------------------------------------------


def _checksum(param: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """The float64 sum of a parameter's values (rounded to ``dtype`` first, if given), over every rank's shard (a
    collective for a DTensor)."""
    values = param.detach() if dtype is None else param.detach().to(dtype)
    if isinstance(values, DTensor):
        return float(torch.sum(values, dtype=torch.float64).full_tensor())
    return float(torch.sum(values, dtype=torch.float64))


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
        # rounded to bfloat16: the same whether the base is held in float32 (FSDP2, export) or only in bfloat16
        # (SlideFSDP's frozen copy); compared where both records have them
        "weight_sums_bf16": {name: _checksum(param, torch.bfloat16) for name, param in weights.items()},
    }


def check_same_base(saved: dict[str, Any], current: dict[str, Any], checkpoint: Any, fix: str | None = None) -> None:
    """Refuse in one line adapters whose checkpoint recorded another base, or other adapter settings, than ``current``
    (``base_record``s); ``fix`` says what to do (default: for a resumed run)."""
    if fix is None:
        fix = f"resume it on the base it was trained on, {saved['base']}, with --model.lora '{json.dumps(saved['lora'])}'"
        if saved["base"].startswith("preset "):  # a preset's random weights are drawn from the run's seed
            fix += f" and --seed_everything {saved['init_seed']}"
    if asdict(as_config(saved["lora"])) != asdict(as_config(current["lora"])):  # older records lack newer fields
        raise RunError(f"checkpoint {checkpoint} holds LoRA adapters {json.dumps(saved['lora'])}, but this run's "
                       f"--model.lora is {json.dumps(current['lora'])}; {fix}")
    if saved["config_sha256"] != current["config_sha256"]:
        raise RunError(f"checkpoint {checkpoint} holds LoRA adapters for another model config than this run's "
                       f"({current['base']}); {fix}")
    sums = "weight_sums_bf16" if "weight_sums_bf16" in saved and "weight_sums_bf16" in current else "weight_sums"
    for name, total in saved[sums].items():
        now = current[sums].get(name)
        if now is None or not math.isclose(total, now, rel_tol=1e-9, abs_tol=1e-9):
            raise RunError(f"checkpoint {checkpoint} holds LoRA adapters trained on another base: the {name} weights "
                           f"of {current['base']} sum to {now}, the checkpoint's base's to {total}; {fix}")
