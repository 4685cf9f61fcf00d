"""Write the sample fine-tuning task of lit_fsdp: reverse a list of 3 to 6 common English words.

    python scripts/make_sft_data.py                      # -> lit_fsdp/data/samples/reverse_words/{train,val}.jsonl
    python scripts/make_sft_data.py --out /tmp/rw --train 100 --val 10 --seed 1

The answer is exact (``"reverse: apple river stone"`` -> ``"stone river apple"``), so a model is scored by exact
match of its greedy generation. Samples mix both formats of ``lit_fsdp.data.sft``: chat messages (some with a
system turn) and prompt/completion. The words are common in WikiText, so a BPE trained on it spells them in few
tokens. No validation word list also occurs in the training file. The same seed writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "lit_fsdp" / "data" / "samples" / "reverse_words"

WORDS = """
apple army battle bird black blue boat book bridge brother building car castle church city coast cold country
day dog door earth east father field fire fish floor flower forest friend game garden gold grass green ground
hand heart hill horse house ice iron island king lake land law light line man market mother mountain music name
night north ocean paper park party peace people queen rain red river road rock room school sea ship silver sky
snow son song south spring star station stone storm street summer sun table tea team time tower town tree valley
village wall war water west white wind window winter woman wood world year young
""".split()
SYSTEM = "Reverse the order of the words you are given."


def reverse_words(count: int, rng: random.Random, exclude: frozenset[str] = frozenset()) -> list[dict]:
    """``count`` samples whose word lists are not in ``exclude`` (prompts), formats mixed."""
    samples = []
    while len(samples) < count:
        words = rng.sample(WORDS, rng.randint(3, 6))
        prompt, answer = "reverse: " + " ".join(words), " ".join(reversed(words))
        if prompt in exclude:
            continue
        style = rng.random()
        if style < 1 / 3:
            samples.append({"prompt": prompt, "completion": answer})
            continue
        messages = [{"role": "system", "content": SYSTEM}] if style < 1 / 2 else []
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        samples.append({"messages": messages})
    return samples


def prompt_of(sample: dict) -> str:
    return sample["prompt"] if "prompt" in sample else sample["messages"][-2]["content"]


def write(out: Path, train: int, val: int, seed: int) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``val.jsonl`` into ``out``; returns their paths."""
    rng = random.Random(seed)
    train_samples = reverse_words(train, rng)
    val_samples = reverse_words(val, rng, frozenset(prompt_of(sample) for sample in train_samples))
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "val.jsonl"
    for path, samples in zip(paths, (train_samples, val_samples)):
        path.write_text("".join(json.dumps(sample, separators=(",", ":")) + "\n" for sample in samples))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder to write train.jsonl and val.jsonl into")
    parser.add_argument("--train", type=int, default=4000, help="training samples")
    parser.add_argument("--val", type=int, default=200, help="validation samples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the word lists and formats")
    args = parser.parse_args(argv)
    for path in write(args.out, args.train, args.val, args.seed):
        print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
