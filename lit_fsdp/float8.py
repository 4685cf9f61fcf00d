"""float8 compute for the transformer blocks' linear layers, through torchao's float8 training (torchtitan's recipe).

``--model.float8 tensorwise`` (or ``rowwise``) swaps each ``nn.Linear`` inside a transformer block for torchao's
``Float8Linear`` (``convert_to_float8_training``), whose three matmuls (output, input gradient, weight gradient) take
their operands cast to float8 with dynamic scales: one per tensor (``tensorwise``, torchao's default) or one per row
(``rowwise``, with scales rounded to powers of two). Its ``weight`` stays the plain parameter it was, under the same
name: the FSDP2 shards, SlideFSDP's host copy, the float32 master and AdamW's state, the checkpoints and the export
are those of the unconverted model. The LM head and the embeddings stay in the strategy's ``param_dtype``, as do
linear layers whose dims are not multiples of 16 (float8 matmuls need them; torchtitan's filter skips them too).
Only ``nn.Linear`` converts: GPT-2's blocks use transformers' ``Conv1D``, so a GPT-2 model is refused in one line.

On a GPU the float8 matmuls are ``torch._scaled_mm`` (compute capability 8.9 or newer: H100, H200, L40S, Ada); they
are fast under ``compile_blocks: true``, which fuses the casts. On a CPU, torchao's emulation
(``Float8LinearConfig.emulate``) rounds the operands to float8 the same way and multiplies them in float32: it is for
tests, measuring numerics only, never speed. torchao's float8 all-gather for FSDP2 stays off: the weights travel in
``param_dtype``.

torchao is an optional extra (``pip install -e ".[float8]"``), imported only when float8 is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Literal

import torch
from torch import nn

from lit_fsdp.errors import OneLineError, RunError

Float8 = Literal["off", "tensorwise", "rowwise"]
RECIPES = ("tensorwise", "rowwise")
#: torch._scaled_mm's float8 matmuls need Ada or Hopper tensor cores.
MIN_CAPABILITY = (8, 9)


def torchao_float8(recipe: str) -> ModuleType:
    """``torchao.float8``, or a one-line error naming the install when torchao is missing."""
    try:
        # Imported by name: torchao is the optional extra float8, not a dependency of the package.
        return importlib.import_module("torchao.float8")
    except ImportError as error:
        raise OneLineError(f"--model.float8 {recipe} needs torchao, which is not installed here ({error}); "
                           'install it with pip install -e ".[float8]", or set --model.float8 off') from error


def block_linears(model: nn.Module, block_class: str | None = None) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` layers float8 converts, by path: inside a transformer block (``block_class`` or the model's
    ``_no_split_modules``), not already converted, and with both dims multiples of 16. The LM head and the embeddings
    are outside the blocks."""
    from lit_fsdp.parallelize import find_blocks

    found: dict[str, nn.Linear] = {}
    for block_name, block in find_blocks(model, block_class):
        for name, module in block.named_modules():
            if type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0:
                found[f"{block_name}.{name}"] = module
    return found


def check(recipe: Float8, model: nn.Module) -> None:
    """Refuse, in one line and before any process starts, a recipe torchao cannot apply to ``model`` (on the meta
    device): an unknown name, blocks without a linear layer to convert, or torchao missing."""
    if recipe == "off":
        return
    if recipe not in RECIPES:
        raise OneLineError(f"--model.float8 {recipe!r} is not a recipe; give off, tensorwise or rowwise")
    if not block_linears(model):
        kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in ("Conv1D", "Linear")})
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise OneLineError(f"--model.float8 {recipe}: the {model_type} model's blocks have no nn.Linear layer with "
                           f"dims that are multiples of 16 to convert (its linear layers: {kinds}; GPT-2's are "
                           "Conv1D); use a Llama-like model (e.g. --model.preset llama-tiny), or set --model.float8 off")
    torchao_float8(recipe)


def float8_config(recipe: str, emulate: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe``, emulated (float32 matmuls of float8-rounded operands) if asked."""
    config = torchao_float8(recipe).Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=True) if emulate else config


def emulated(device: torch.device, recipe: str) -> bool:
    """Whether ``device`` emulates float8 (a CPU), or a one-line error if it is a GPU without float8 matmuls."""
    if device.type != "cuda":
        return True
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise RunError(f"--model.float8 {recipe} needs a GPU with float8 matmuls (compute capability 8.9 or newer: "
                       f"H100, H200, L40S); {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: "
                       "set --model.float8 off")
    return False


def convert(model: nn.Module, recipe: Float8, device: torch.device, block_class: str | None = None) -> list[str]:
    """Swap the blocks' linear layers (``block_linears``) for torchao's ``Float8Linear`` in place, emulated on a
    CPU; returns their paths. Works on the meta device: the new module takes the old one's parameters as they are.
    Run before LoRA attaches its adapters (which stay plain float32 parameters, multiplied in ``param_dtype``)."""
    if recipe == "off":
        return []
    float8 = torchao_float8(recipe)
    targets = block_linears(model, block_class)
    chosen = {id(module) for module in targets.values()}
    float8.convert_to_float8_training(model, config=float8_config(recipe, emulated(device, recipe)),
                                      module_filter_fn=lambda module, path: id(module) in chosen)
    return list(targets)
