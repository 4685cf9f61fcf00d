"""LoRA on parameters (peft's ``target_parameters``): adapters on a mixture of experts' fused expert tensors.

transformers 5 holds a MoE layer's experts as 3D parameters of a module that is not a linear layer
(``mlp.experts.gate_up_proj``: experts x out x in) and computes them with ``grouped_mm``, which reads
``self.gate_up_proj`` itself: there is no per-expert output for a forward hook to add to. The adapters change the
weight instead, as peft's ``ParamWrapper`` does: while the module runs, ``self.gate_up_proj`` is ``W + B @ A * scale``
per expert, a tensor with a graph back to A and B.

How the weight is swapped: a forward pre-hook on the owning module writes ``W + delta`` into the module's instance
``__dict__`` under the parameter's name, which attribute lookup finds before ``nn.Module.__getattr__`` reaches
``_parameters``; a forward hook (``always_call``: also when the forward raises) removes it. The parameter itself is
never moved or renamed, so state-dict keys, loading by name, checkpoints, FSDP2's and SlideFSDP's parameter
management stay those of the plain model. FSDP2 unshards in the block's pre-forward, before the experts' pre-hook
runs, so the hook reads the unsharded ``_parameters`` entry (and the unsharded adapters); SlideFSDP replaces a
parameter's ``.data`` in place, which the hook reads the same way; an activation checkpoint's recompute runs the
hooks again. ``torch.nn.utils.parametrize`` (peft's way) was not chosen: it moves the parameter to
``<module>.parametrizations.<name>.original``, another state-dict key, and FSDP2 would shard and gather that instead.

The adapters are peft's, in its layout, so export is a rename: for a parameter of E experts, ``A`` is
(rank x E) x in with each expert's rank rows together, ``B`` is out x (rank x E) with its columns rank-major (column
``r x E + e``), and ``delta[e] = B.reshape(out, rank, E)[:, :, e] @ A.reshape(E, rank, in)[e] * scale``. A module
marked ``is_transposed`` holds experts x in x out, and takes the delta transposed; a 2D parameter (out x in) is one
expert. The delta is added in the weight's dtype, as peft does.

The effective weight of every adapted layer is a new tensor the size of its experts, kept for the backward by
``grouped_mm`` (unless activation checkpointing recomputes it): peft's cost as well.
"""

from __future__ import annotations

import torch
from torch import nn

SUFFIXES = ("lora_A", "lora_B")


def adapter_shapes(weight: torch.Tensor, module: nn.Module, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of A and B (peft's) for ``weight``, a 3D expert tensor of ``module`` or a 2D out x in matrix."""
    experts, fan_in, fan_out = _dimensions(weight, module)
    return (rank * experts, fan_in), (fan_out, rank * experts)


def _dimensions(weight: torch.Tensor, module: nn.Module) -> tuple[int, int, int]:
    """Experts, in and out features of ``weight``: experts x out x in, or x in x out where ``module.is_transposed``."""
    if weight.dim() == 2:
        return 1, weight.shape[1], weight.shape[0]
    experts, first, second = weight.shape
    return (experts, first, second) if _transposed(weight, module) else (experts, second, first)


def _transposed(weight: torch.Tensor, module: nn.Module) -> bool:
    return weight.dim() == 3 and bool(getattr(module, "is_transposed", False))


def attach(module: nn.Module, name: str, path: str, rank: int, scale: float, device: torch.device | str | None) -> None:
    """Give ``module``'s parameter ``name`` (clean path ``path``) float32 adapters ``<name>_lora_A`` and
    ``<name>_lora_B`` (on ``device``, default the weight's) and, once per module, the hooks that swap in its adapted
    weight during forward."""
    weight = module._parameters[name]
    a_shape, b_shape = adapter_shapes(weight, module, rank)
    device = device or weight.device
    module.register_parameter(f"{name}_lora_A", nn.Parameter(torch.empty(a_shape, device=device, dtype=torch.float32)))
    module.register_parameter(f"{name}_lora_B", nn.Parameter(torch.empty(b_shape, device=device, dtype=torch.float32)))
    if not hasattr(module, "lora_parameters"):
        module.lora_parameters, module.lora_scale = {}, scale
        module.lora_parameter_hooks = (module.register_forward_pre_hook(_use_adapted_weights),
                                       module.register_forward_hook(_drop_adapted_weights, always_call=True))
    module.lora_parameters[name] = path


def adapted(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Every adapted parameter as (clean path, owning module, name), in model order."""
    return [(path, module, name) for module in model.modules() if hasattr(module, "lora_parameters")
            for name, path in module.lora_parameters.items()]


def adapters(module: nn.Module, name: str) -> tuple[nn.Parameter, nn.Parameter]:
    """A and B of ``module``'s parameter ``name``."""
    return getattr(module, f"{name}_lora_A"), getattr(module, f"{name}_lora_B")


def adapted_weight(weight: torch.Tensor, module: nn.Module, name: str) -> torch.Tensor:
    """``weight + delta`` for ``module``'s parameter ``name`` (``weight``: its current, unsharded value), in
    ``weight``'s dtype: one ``baddbmm``, as peft folds it (``_LoraFactorsProxy``)."""
    a, b = adapters(module, name)
    lhs, rhs = _factors(weight, module, a.to(weight.dtype), b.to(weight.dtype))
    stacked = weight if weight.dim() == 3 else weight.unsqueeze(0)
    # a parametrization may not change the weight's dtype: autocast would run the baddbmm in its own (peft's reason)
    with torch.autocast(weight.device.type, enabled=False):
        total = torch.baddbmm(stacked, lhs, rhs, alpha=module.lora_scale)
    return total if weight.dim() == 3 else total.squeeze(0)


def delta(weight: torch.Tensor, module: nn.Module, name: str) -> torch.Tensor:
    """``B @ A * scale`` per expert, in float32 and ``weight``'s layout: what ``merge`` adds."""
    a, b = adapters(module, name)
    lhs, rhs = _factors(weight, module, a.float(), b.float())
    total = torch.bmm(lhs, rhs) * module.lora_scale
    return total if weight.dim() == 3 else total.squeeze(0)


def _factors(weight: torch.Tensor, module: nn.Module, a: torch.Tensor, b: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lhs, rhs) with ``lhs @ rhs`` the per-expert delta before scaling, in ``weight``'s layout (peft's
    ``get_delta_factors``): A's rows expert-major, B's columns rank-major."""
    experts = weight.shape[0] if weight.dim() == 3 else 1
    lhs = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # experts x out x rank
    rhs = a.reshape(experts, -1, a.shape[-1])  # experts x rank x in
    return (rhs.mT, lhs.mT) if _transposed(weight, module) else (lhs, rhs)


def _use_adapted_weights(module: nn.Module, args: tuple) -> None:
    """Shadow each adapted parameter with its adapted weight for this forward (instance ``__dict__`` before
    ``_parameters``)."""
    for name in module.lora_parameters:
        module.__dict__[name] = adapted_weight(module._parameters[name], module, name)


def _drop_adapted_weights(module: nn.Module, args: tuple, output: object) -> None:
    for name in module.lora_parameters:
        module.__dict__.pop(name, None)


def merge(model: nn.Module) -> None:
    """Fold each adapted parameter's delta into it and remove its adapters and hooks."""
    with torch.no_grad():
        for _, module, name in adapted(model):
            weight = module._parameters[name]
            weight += delta(weight, module, name).to(weight.dtype)
        for module in {id(m): m for _, m, _ in adapted(model)}.values():
            for hook in module.lora_parameter_hooks:
                hook.remove()
            for name in module.lora_parameters:
                for suffix in SUFFIXES:
                    delattr(module, f"{name}_{suffix}")
            for attribute in ("lora_parameters", "lora_scale", "lora_parameter_hooks"):
                delattr(module, attribute)


def peft_names(model: nn.Module) -> dict[str, str]:
    """peft's key (``base_model.model.<module>.[base_layer.]lora_A.weight``) of each adapter's clean name. peft wraps
    one parameter per ``ParamWrapper``, the module's parameters in their order, each wrapper around the last: the
    first adapted parameter sits deepest, under one ``base_layer`` per parameter adapted after it."""
    names = {}
    for module in {id(m): m for _, m, _ in adapted(model)}.values():
        ordered = [name for name in module._parameters if name in module.lora_parameters]
        for index, name in enumerate(ordered):
            owner = module.lora_parameters[name].rpartition(".")[0]
            nesting = "base_layer." * (len(ordered) - 1 - index)
            for suffix in SUFFIXES:
                names[f"{owner}.{name}_{suffix}"] = f"base_model.model.{owner}.{nesting}{suffix}.weight"
    return names


def named_adapters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every A and B of every adapted parameter by clean name (``<module>.<parameter>_lora_A``)."""
    return {f"{path.rpartition('.')[0]}.{name}_{suffix}": param for path, module, name in adapted(model)
            for suffix, param in zip(SUFFIXES, adapters(module, name))}
