"""lit_fsdp: train Hugging Face causal LMs with PyTorch FSDP2 under Lightning.

Importing the package loads nothing heavy (no torch, no Lightning): ``python -m lit_fsdp --help`` and a mistyped
option answer at once. ``FSDP2Strategy`` and ``DDPStrategy`` load on first use; importing their modules registers
their names (``lit_fsdp``, ``lit_fsdp_ddp``) with Lightning's strategy registry.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: The public names and the modules that define them.
EXPORTS = {"FSDP2Strategy": "lit_fsdp.strategy", "DDPStrategy": "lit_fsdp.ddp"}

__all__ = list(EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module 'lit_fsdp' has no attribute {name!r}")
    return getattr(import_module(EXPORTS[name]), name)
