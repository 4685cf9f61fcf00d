"""A mixture of experts' experts on the CPU: transformers' grouped matmul against its loop over experts.

One Qwen3-MoE layer's experts (``--experts`` of them, each token sent to the top ``--top-k``), forward and backward
on ``--tokens`` tokens, timed with the experts implementation set to ``grouped_mm`` (one
``torch.nn.functional.grouped_mm`` over the tokens sorted by expert, what lit_fsdp runs) and to ``eager`` (the
modeling file's Python loop over the experts that got tokens). The two alternate ``--repeats`` times; the row gives
the median of each and their ratio, and is appended to ``--out``/results.jsonl.

    python scripts/bench_moe_kernel.py --out runs/bench_moe_kernel
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lit_fsdp from this checkout

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lit_fsdp.presets import build_config  # noqa: E402

IMPLEMENTATIONS = ("grouped_mm", "eager")


def experts_of(args: argparse.Namespace) -> torch.nn.Module:
    """The experts module of a one-layer Qwen3-MoE of the asked shape (random weights)."""
    config = build_config("qwen3-moe-tiny", {
        "hidden_size": args.hidden, "moe_intermediate_size": args.intermediate, "num_experts": args.experts,
        "num_experts_per_tok": args.top_k, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    })
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def seconds(model: torch.nn.Module, implementation: str, tokens: int, hidden: int, top_k: int, experts: int) -> float:
    """Forward and backward of the experts on ``tokens`` random tokens with a random top-k routing."""
    model.set_experts_implementation(implementation)
    block = model.model.layers[0].mlp
    generator = torch.Generator().manual_seed(1)
    states = torch.randn(tokens, hidden, generator=generator, requires_grad=True)
    index = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
    start = time.perf_counter()
    block.experts(states, index, weights).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="runs/bench_moe_kernel")
    args = parser.parse_args()
    model = experts_of(args)
    shape = (args.tokens, args.hidden, args.top_k, args.experts)
    for implementation in IMPLEMENTATIONS:  # a first, untimed pass of each: allocations and lazy initialisation
        seconds(model, implementation, *shape)
    times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for _ in range(args.repeats):
        for implementation in IMPLEMENTATIONS:
            times[implementation].append(seconds(model, implementation, *shape))
    medians = {name: statistics.median(values) for name, values in times.items()}
    row = {
        "tokens": args.tokens, "hidden": args.hidden, "intermediate": args.intermediate, "experts": args.experts,
        "top_k": args.top_k, "repeats": args.repeats, "threads": torch.get_num_threads(), "torch": torch.__version__,
        **{f"{name}_s": medians[name] for name in IMPLEMENTATIONS},
        "eager_over_grouped": medians["eager"] / medians["grouped_mm"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print("| tokens | experts (top-k) | grouped_mm | eager loop | eager / grouped |")
    print("|---|---|---|---|---|")
    print(f"| {args.tokens} | {args.experts} (top-{args.top_k}) | {medians['grouped_mm'] * 1e3:.1f} ms | "
          f"{medians['eager'] * 1e3:.1f} ms | {row['eager_over_grouped']:.2f}x |")


if __name__ == "__main__":
    main()
