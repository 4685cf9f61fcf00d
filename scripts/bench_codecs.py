"""How fast each compressor encodes and decodes: ns per value and GB/s of fp32 input, per method and device.

Each method compresses and decompresses one gradient-sized tensor (default 4M values, heavy-tailed like
a real gradient) ``--repeats`` times after ``--warmup`` calls; the median of the timed calls is
reported (device-synchronised on GPUs). ``torch.topk`` on the same tensor at the same k is a reference
row for the sparsifiers' selection. Run it on an idle machine, with one thread (the default) to
compare with a rank's single core:

    python scripts/bench_codecs.py                      # CPU, 1 thread
    python scripts/bench_codecs.py --device cuda        # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from compress.config import METHODS, CompressionConfig

# Methods that are communicators rather than tensor codecs (powersgd and sketch exchange in rounds), or need no codec
# (onebit_adam and zero_one_adam use signsgd's codec).
SKIPPED = {"none", "powersgd", "sketch", "onebit_adam", "zero_one_adam"}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gradient(n: int, device: torch.device) -> torch.Tensor:
    """Heavy-tailed values (Student t, 3 degrees of freedom), scaled like a gradient."""
    generator = torch.Generator().manual_seed(0)
    normal = torch.randn(n, generator=generator)
    chi = torch.randn(3, n, generator=generator).square().sum(0) / 3
    return (1e-3 * normal / chi.sqrt()).to(device)


def bench_method(method: str, x: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    compressor = CompressionConfig(method=method).build(rank=0)
    payload = compressor.compress(x, "bench", 1)
    encode = median_seconds(lambda: compressor.compress(x, "bench", 1), x.device, args.warmup, args.repeats)
    decode = median_seconds(lambda: compressor.decompress(payload), x.device, args.warmup, args.repeats)
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
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in SKIPPED])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = gradient(args.numel, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"{args.numel} fp32 values on {name}; median of {args.repeats} calls\n")
    print("| method | encode ns/value | decode ns/value | both ns/value | GB/s of fp32 input | ratio vs fp32 |")
    print("|---|---|---|---|---|---|")
    for method in args.methods:
        result = bench_method(method, x, args)
        print(row(method, x.numel(), result["encode_s"], result["decode_s"], result["ratio"]), flush=True)
    k = max(1, int(0.01 * x.numel()))
    select = median_seconds(lambda: torch.topk(x.abs(), k, sorted=False), device, args.warmup, args.repeats)
    print(row("torch.topk (k = 1%, reference)", x.numel(), select, 0.0, None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
