"""How fast each compressor encodes and decodes: ns per value and GB/s of fp32 input, per method and device.

Each method compresses and decompresses one gradient-sized tensor (default 4M values, heavy-tailed like
a real gradient), timed by ``torch.utils.benchmark.Timer`` (``median_seconds``): ``--warmup`` calls, then
blocks of calls, for at least ``--repeats`` calls' time, until their spread is small; the median time per
call is reported (the Timer synchronises the GPU at each reading). ``torch.topk`` on the same tensor at the
same k is a reference row for the sparsifiers' selection. Run it on an idle machine, with one thread (the
default) to compare with a rank's single core:

    python scripts/bench_codecs.py                      # CPU, 1 thread
    python scripts/bench_codecs.py --device cuda        # on a GPU
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch
from torch.utils import benchmark

from compress.config import METHODS, CompressionConfig

# Methods that are communicators rather than tensor codecs (powersgd and sketch exchange in rounds), or need no codec
# (onebit_adam and zero_one_adam use signsgd's codec).
SKIPPED = {"none", "powersgd", "sketch", "onebit_adam", "zero_one_adam"}


def median_seconds(fn: Callable[[], object], threads: int, warmup: int, repeats: int) -> float:
    """Median seconds per call of ``fn`` on ``threads`` CPU threads, by ``torch.utils.benchmark.Timer`` (which
    synchronises the GPU at each reading): ``warmup`` calls (at least one: their mean sizes the run; the Timer adds
    two), then ``adaptive_autorange``: blocks of calls (one call each for a codec at the default size), at least four
    and ``repeats`` calls' time, until their spread (IQR) is within 10% of their median, or for 10 s."""
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads)
    per_call = timer.timeit(max(warmup, 1)).mean
    return timer.adaptive_autorange(min_run_time=repeats * per_call).median


def gradient(n: int, device: torch.device) -> torch.Tensor:
    """Heavy-tailed values (Student t, 3 degrees of freedom), scaled like a gradient."""
    generator = torch.Generator().manual_seed(0)
    normal = torch.randn(n, generator=generator)
    chi = torch.randn(3, n, generator=generator).square().sum(0) / 3
    return (1e-3 * normal / chi.sqrt()).to(device)


def bench_method(method: str, x: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    compressor = CompressionConfig(method=method).build(rank=0)
    payload = compressor.compress(x, "bench", 1)
    encode = median_seconds(lambda: compressor.compress(x, "bench", 1), args.threads, args.warmup, args.repeats)
    decode = median_seconds(lambda: compressor.decompress(payload), args.threads, args.warmup, args.repeats)
    return {"encode_s": encode, "decode_s": decode, "ratio": x.numel() * 4 / payload.nbytes}


def row(name: str, n: int, encode_s: float, decode_s: float, ratio: float | None) -> str:
    total = encode_s + decode_s
    ratio_text = f"{ratio:.1f}x" if ratio else ""
    return (f"| {name} | {encode_s / n * 1e9:.2f} | {decode_s / n * 1e9:.2f} | {total / n * 1e9:.2f} | "
            f"{n * 4 / total / 1e9:.2f} | {ratio_text} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--numel", type=int, default=4 * 2**20)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (a rank has about one core)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    parser.add_argument("--repeats", type=int, default=7, help="timed for at least this many calls' time")
    parser.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in SKIPPED])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = gradient(args.numel, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"{args.numel} fp32 values on {name}; median per call over at least {args.repeats} calls' time\n")
    print("| method | encode ns/value | decode ns/value | both ns/value | GB/s of fp32 input | ratio vs fp32 |")
    print("|---|---|---|---|---|---|")
    for method in args.methods:
        result = bench_method(method, x, args)
        print(row(method, x.numel(), result["encode_s"], result["decode_s"], result["ratio"]), flush=True)
    k = max(1, int(0.01 * x.numel()))
    select = median_seconds(lambda: torch.topk(x.abs(), k, sorted=False), args.threads, args.warmup, args.repeats)
    print(row("torch.topk (k = 1%, reference)", x.numel(), select, 0.0, None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
