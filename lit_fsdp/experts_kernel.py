"""Which kernel computes a mixture of experts' experts, and one warning line where it is not a grouped matmul.

transformers runs a MoE layer's experts through the implementation its config names (``_experts_implementation``,
``grouped_mm`` by default where torch has it): one grouped matrix multiply over the tokens sorted by expert
(``torch.nn.functional.grouped_mm``). Where torch's kernel cannot run, transformers falls back without a word: to its
own grouped kernel (a loop in C++ over experts; under ``torch.compile`` for any dtype but bfloat16, on GPUs before
compute capability 8.0, on torch without ``grouped_mm``), or, configured ``eager``, to a Python loop over the experts
(scripts/bench_moe_kernel.py measures the two on CPU).
"""

from __future__ import annotations

import torch
from torch import nn


def experts_implementation(model: nn.Module) -> str | None:
    """The experts implementation transformers set for ``model``; None for a model without experts."""
    if not any(type(module).__name__.endswith("Experts") for module in model.modules()):
        return None
    return getattr(model.config, "_experts_implementation", None) or "eager"


def fallback(model: nn.Module, device: torch.device, compiled: bool = False,
             dtype: torch.dtype | None = None) -> str | None:
    """Why ``model``'s experts will not run torch's grouped matmul on ``device`` (compiled or not, in ``dtype``), in one
    line; None where they will, or where the model has no experts."""
    implementation = experts_implementation(model)
    if implementation is None or implementation not in ("grouped_mm", "eager"):
        return None  # dense, or a kernel of the user's choice (batched_mm, deepgemm, sonicmoe)
    if implementation == "eager":
        return ("the experts run as a Python loop over experts (experts_implementation eager); "
                "--model.config_overrides '{_experts_implementation: grouped_mm}' runs one grouped matmul")
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return (f"torch {torch.__version__} has no grouped_mm: transformers runs its fallback kernel over the experts; "
                "torch >= 2.9 has it")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "grouped_mm needs a GPU of compute capability 8.0+: transformers runs its fallback kernel over the experts"
    if compiled and dtype not in (None, torch.bfloat16):
        return (f"compiled experts in {str(dtype).removeprefix('torch.')} cannot use grouped_mm (inductor lowers it "
                "for bfloat16 only): transformers runs its fallback kernel; use param_dtype bfloat16 or eager blocks")
    return None
