"""Packing against padding: answer tokens trained per second on samples of widely spread lengths.

Samples are prompt/completion pairs of random words whose lengths follow a log-normal distribution (median about
``--median`` tokens, a few reaching ``--seq-len``: the spread of chat data); both modes go through
``lit_fsdp.data.sft.SFTDataModule`` (packing true or false) and the same model, one process, forward, backward and
AdamW. Packed and padded runs alternate ``--repeats`` times; the table gives the median of each.

    python scripts/bench_packing.py --out runs/bench_packing
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lit_fsdp from this checkout

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lit_fsdp.data.sft import SFTDataModule  # noqa: E402
from lit_fsdp.data.tokenizer import train_bpe  # noqa: E402
from lit_fsdp.loss import IGNORE_INDEX  # noqa: E402
from lit_fsdp.presets import build_config  # noqa: E402

WORDS = [f"w{i}" for i in range(300)]


def write_samples(path: Path, count: int, median: int, seq_len: int, rng: random.Random) -> list[str]:
    """``count`` prompt/completion samples of about ``median`` words in all (log-normal, sigma 0.8, capped)."""
    texts = []
    with path.open("w") as f:
        for _ in range(count):
            words = min(seq_len - 8, max(4, int(rng.lognormvariate(0, 0.8) * median)))
            prompt_words = max(1, words // 3)
            prompt = " ".join(rng.choices(WORDS, k=prompt_words))
            completion = " ".join(rng.choices(WORDS, k=words - prompt_words))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
            texts.append(prompt + " " + completion)
    return texts


def timed_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[dict]) -> tuple[float, int, int]:
    """Seconds, answer tokens and positions of training on ``batches``."""
    answer_tokens = positions = 0
    start = time.perf_counter()
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                                                 ignore_index=IGNORE_INDEX)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        answer_tokens += int((batch["labels"] != IGNORE_INDEX).sum())
        positions += batch["input_ids"].numel()
    return time.perf_counter() - start, answer_tokens, positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_packing"))
    parser.add_argument("--samples", type=int, default=1200)
    parser.add_argument("--median", type=int, default=60, help="median words per sample")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps timed per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="gpt2-small")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    texts = write_samples(args.out / "train.jsonl", args.samples, args.median, args.seq_len, rng)
    tokenizer = train_bpe(texts[:500], 512)
    tokenizer.save_pretrained(args.out / "tokenizer")
    loaders = {}
    for packing in (True, False):
        data = SFTDataModule(str(args.out / "train.jsonl"), tokenizer_path=str(args.out / "tokenizer"),
                             seq_len=args.seq_len, batch_size=args.batch_size, packing=packing,
                             cache_dir=str(args.out / "cache"), val_fraction=0.05)
        data.setup("fit")
        loader = iter(data.train_dataloader())
        loaders["packed" if packing else "padded"] = [next(loader) for _ in range(args.steps + 1)]
    config = build_config(args.preset, {"vocab_size": len(tokenizer), "n_positions": args.seq_len})
    times: dict[str, list[float]] = {"packed": [], "padded": []}
    fill: dict[str, float] = {}
    for _ in range(args.repeats):
        for mode, batches in loaders.items():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            timed_steps(model, optimizer, batches[:1])  # warm-up
            seconds, answers, positions = timed_steps(model, optimizer, batches[1:])
            times[mode].append(answers / seconds)
            fill[mode] = sum(int((b["segment_ids"] > 0).sum()) for b in batches[1:]) / positions
    record = {"preset": args.preset, "seq_len": args.seq_len, "batch_size": args.batch_size, "median_words": args.median,
              "threads": torch.get_num_threads(), **{f"{m}_answer_tokens_per_s": statistics.median(v) for m, v in times.items()},
              **{f"{m}_fill": f for m, f in fill.items()}, "runs": times}
    with (args.out / "results.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"{args.preset}, seq_len {args.seq_len}, {args.batch_size} rows per step, {torch.get_num_threads()} threads; "
          f"median of {args.repeats} alternated repeats of {args.steps} steps")
    print("| mode | answer tokens/s | rows filled with tokens | speed-up |")
    print("|---|---|---|---|")
    padded = statistics.median(times["padded"])
    for mode in ("padded", "packed"):
        rate = statistics.median(times[mode])
        print(f"| {mode} | {rate:,.0f} | {fill[mode]:.0%} | {rate / padded:.2f}x |")


if __name__ == "__main__":
    main()
