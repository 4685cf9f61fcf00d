"""The model summary at the start of fit: Lightning's table of the module's parts, sized by the strategy, no FLOPs."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

from lit_fsdp.reporting import strategy_report

#: Lightning sizes the parameters in float32 whatever the precision; so does this summary.
BYTES_PER_PARAMETER = 4


class ModelSummary(LightningModelSummary):
    """Lightning's ModelSummary (same ``max_depth``), with each parameter counted whole as the strategy gives it
    (``StrategyReport.whole_numels``: SlideFSDP's parameters are empty between loads, where Lightning counted 0) and
    without Lightning's FLOPs, which it measures only on an ``example_input_array`` (CausalLM has none: it said 0;
    ``callbacks.Throughput`` counts the model's FLOPs). The CLI gives every fit one unless
    ``--trainer.enable_model_summary false``."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._max_depth and trainer.is_global_zero:
            rank_zero_info("\n" + summary_table(pl_module, strategy_report(trainer).whole_numels(pl_module),
                                                self._max_depth))


def summary_table(module: torch.nn.Module, sizes: dict[int, int], max_depth: int) -> str:
    """Lightning's plain summary: a row per part down to ``max_depth`` (name, type, parameters, mode), then the trainable,
    frozen and total parameters and their size, each parameter counted once at ``sizes[id(parameter)]``."""

    def count(part: torch.nn.Module, trainable: bool | None = None) -> int:
        return sum(sizes[id(p)] for p in part.parameters() if trainable is None or p.requires_grad == trainable)

    parts = [(name, part) for name, part in module.named_modules() if name and name.count(".") < max_depth]
    columns: list[tuple[str, list[str]]] = [
        ("", [str(index) for index in range(len(parts))]),
        ("Name", [name for name, _ in parts]),
        ("Type", [type(part).__name__ for _, part in parts]),
        ("Params", [get_human_readable_count(count(part)) for _, part in parts]),
        ("Mode", ["train" if part.training else "eval" for _, part in parts]),
    ]
    widths = [max(len(heading), *(len(cell) for cell in cells)) for heading, cells in columns]
    lines = [" | ".join(heading.ljust(width) for (heading, _), width in zip(columns, widths))]
    rule = "-" * len(lines[0])
    lines.append(rule)
    lines += [" | ".join(cells[row].ljust(width) for (_, cells), width in zip(columns, widths))
              for row in range(len(parts))]
    lines.append(rule)
    total, trainable = count(module), count(module, trainable=True)
    figures = [(get_human_readable_count(trainable), "Trainable params"),
               (get_human_readable_count(total - trainable), "Non-trainable params"),
               (get_human_readable_count(total), "Total params"),
               (get_formatted_model_size(total * BYTES_PER_PARAMETER / 1e6), "Total estimated model params size (MB)")]
    lines += [f"{figure:<10}{what}" for figure, what in figures]
    return "\n".join(lines)
