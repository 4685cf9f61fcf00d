"""``compile_blocks`` under SlideFSDP: each block's own ``forward`` compiled, the engine's hooks left outside.

``nn.Module.compile()`` (FSDP2's ``apply_compile``) compiles ``_call_impl``, the engine's forward hooks with it: they
load and release device slots, record events and wrap outputs in ``BeforeBackward``, Python side effects that
would graph-break or recompile. Compiling the bound ``forward`` instead keeps ``_call_impl`` and its hooks eager and
compiles only the block's arithmetic, inside ``CheckpointedBlock``'s recomputation too.

A block's parameters are rebound to views of whichever device slot it is loaded into (``residency.DeviceWindow``),
and to empty tensors between uses. Dynamo lifts parameters into graph inputs (``inline_inbuilt_nn_modules``): a
rebound parameter with the same shape, dtype and strides passes the guards and is read from its new slot at every
call, and the blocks share one graph per grad mode (recomputation runs it without grad, then with). Nothing
here may bake the slots' addresses or values into a graph: no ``mode="reduce-overhead"`` (CUDA graphs), and inductor's
freezing is refused; either would keep computing with the weights of the slot the graph was captured on.
"""

from __future__ import annotations

import torch
from torch import nn

from lit_fsdp.errors import OneLineError


class CompileUnavailableError(OneLineError):
    """``compile_blocks: true`` where ``torch.compile`` cannot run."""


def compile_unavailable(device: torch.device) -> str | None:
    """Why inductor cannot compile for ``device`` here (this Python, no C++ compiler, no triton), or None."""
    from torch._dynamo.eval_frame import check_if_inductor_supported

    try:
        check_if_inductor_supported()
    except RuntimeError as error:
        return str(error).strip().splitlines()[0]
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "inductor needs triton for CUDA devices and it is not installed"
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as error:  # noqa: BLE001 - InvalidCxxCompiler, or a failed conda install it may attempt
            return str(error).strip().splitlines()[0]
    return None


def compile_forwards(blocks: list[tuple[str, nn.Module]], device: torch.device) -> None:
    """Replace each block's ``forward`` with its compiled version (module docstring); parameter names do not change."""
    reason = compile_unavailable(device)
    if reason is not None:
        raise CompileUnavailableError(f"SlideFSDP compile_blocks: true needs torch.compile on {device.type}, but "
                                      f"{reason}; fix that or set --trainer.strategy.init_args.compile_blocks false")
    from torch._inductor import config

    if config.freezing:
        raise CompileUnavailableError(
            "SlideFSDP compile_blocks: true with inductor's freezing on (TORCHINDUCTOR_FREEZING=1), which bakes the "
            "weights of one slot into the graphs; unset it, or set --trainer.strategy.init_args.compile_blocks false")
    for _, block in blocks:
        block.forward = torch.compile(block.forward)
