"""Overhead of `lit_fsdp fit` against a plain PyTorch FSDP2 loop: tokens/s of both, in one run, as a ratio.

Both sides train the same Hugging Face model (a lit_fsdp preset shape) with the same global batch,
sequence length, precision and world size, one FSDP unit per block plus the root, AdamW, no
gradient clipping; both time optimizer steps between device synchronisations and drop the same
warm-up steps. The plain loop feeds pre-generated random tokens that live on the device; `fit`
reads the synthetic DataModule through its DataLoader, logs, and runs its callbacks: that is the
overhead measured.

    python scripts/bench_overhead.py --preset gpt2-small --devices 2 --accelerator cpu
    python scripts/bench_overhead.py --preset gpt2-124m --devices 1 --accelerator gpu --param-dtype bfloat16 \\
        --seq-len 1024 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from callbacks.throughput import Throughput
from lit_fsdp.presets import PRESETS, build_config

REPO = Path(__file__).resolve().parents[1]

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    """One rank of the plain loop: fully_shard per block and root, AdamW, timed steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.accelerator == "gpu"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.devices)
    # Lightning gives each process cpu_count / processes threads unless OMP_NUM_THREADS is set; so do we.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(build_config(args.preset)).to(device)
    model.config.use_cache = False
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, args.param_dtype), reduce_dtype=torch.float32)
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (args.steps, args.batch_size, args.seq_len + 1), device=device)
    seconds = []
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(args.steps):
        logits = model(input_ids=tokens[step, :, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[step, :, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        seconds.append(now - start)
        start = now
    if rank == 0:
        # The same statistics code as the fit side's Throughput callback, over the same steps.
        timer = Throughput(warmup_steps=args.warmup)
        timer.step_seconds, timer.tokens_per_step = seconds, args.batch_size * args.seq_len * args.devices
        Path(out).write_text(json.dumps(timer.summary()))
    dist.destroy_process_group()


def run_plain(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    out = workdir / "plain.json"
    mp.spawn(plain_worker, args=(args, free_port(), str(out)), nprocs=args.devices, join=True)
    return json.loads(out.read_text())


def run_fit(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """`python -m lit_fsdp fit` on the quickstart config, changed to the benchmark's shape."""
    overrides = workdir / "bench.yaml"
    overrides.write_text(json.dumps({
        "trainer": {
            "callbacks": [{"class_path": "callbacks.Throughput", "init_args": {"warmup_steps": args.warmup}}],
            "gradient_clip_val": None,
        }
    }))
    command = [
        sys.executable, "-m", "lit_fsdp", "fit",
        "--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(overrides),
        "--trainer.accelerator", args.accelerator,
        "--trainer.devices", str(args.devices),
        "--trainer.max_steps", str(args.steps),
        "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(workdir / "fit"),
        "--trainer.strategy.init_args.param_dtype", args.param_dtype,
        "--trainer.strategy.init_args.reduce_dtype", "float32",
        "--model.preset", args.preset,
        "--model.learning_rate", "1e-4",
        "--data.vocab_size", str(PRESETS[args.preset]["vocab_size"]),
        "--data.seq_len", str(args.seq_len),
        "--data.batch_size", str(args.batch_size),
        "--data.num_train_blocks", str(args.batch_size * args.devices * (args.steps + 1)),
        "--seed_everything", str(args.seed),
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(command, cwd=workdir, env=env, check=True)
    return json.loads((workdir / "fit" / "throughput.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-small", choices=sorted(PRESETS))
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="alternate plain/fit this many times")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", type=Path, help="append the result as one JSON line")
    args = parser.parse_args()

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            workdir = Path(tmp) / str(repeat)
            workdir.mkdir()
            plain, ours = run_plain(args, workdir), run_fit(args, workdir)
            runs.append({"plain": plain, "fit": ours, "ratio": ours["tokens_per_s"] / plain["tokens_per_s"]})
    ratios = [run["ratio"] for run in runs]
    result = {
        "preset": args.preset, "accelerator": args.accelerator, "devices": args.devices,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "param_dtype": args.param_dtype,
        "steps": args.steps, "warmup": args.warmup,
        "plain_tokens_per_s": statistics.fmean(r["plain"]["tokens_per_s"] for r in runs),
        "fit_tokens_per_s": statistics.fmean(r["fit"]["tokens_per_s"] for r in runs),
        "ratio_mean": statistics.fmean(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.output:
        with open(args.output, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
