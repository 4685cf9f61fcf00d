"""SlideFSDP beside the peers a user would pick instead, on the same card: the same Llama shape (random weights),
sequence length, tokens per step, bfloat16 compute, activation checkpointing on every block, chunked loss and AdamW
(lr, betas, eps, weight decay, clipping at 1.0).

Peers: DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU (DeepSpeedCPUAdam), DeepSpeed ZeRO-2 with
the optimizer offloaded (bfloat16 weights on the device), FSDP2 (``fully_shard``) with ``CPUOffloadPolicy``,
Lightning's ``FSDPStrategy(cpu_offload=True)`` in a Trainer, and SlideFSDP through ``python -m lit_fsdp fit`` with
configs/llama_8b_offload.yaml (its delayed update past the warm-up; ``slide_fsdp_exact``: the synchronous update with
float32 moments, the peers' AdamW). Each peer runs in its own process group with a deadline; one that fails is a row
with its error's first line, and one whose host state cannot fit (16 to 18 B/param: float32 master weights, moments
and gradients) is refused before it starts, with what it would ask for. Each row: tokens/s and MFU over the steps after
``--warmup``, device peak, rank 0's host peak RSS and every step's time. One JSON line per row is appended to
``--out``; the table is printed.

    python scripts/bench_peers.py                       # GPU: llama-8b, then the most blocks every peer fits
    python scripts/bench_peers.py --layers 8 --steps 7  # 8 of the 8B's 32 blocks
    python scripts/bench_peers.py --device cpu          # llama-tiny on 2 processes (gloo): every peer's code path
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from peers_table import HOST_RESERVE_GIB, PEERS, Shape, auto_layers, refusal, table

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
#: AdamW's eps: torch's default, the one lit_fsdp's CausalLM builds its AdamW with (it has no knob for it).
EPS = 1e-8
#: Peers the CPU mode leaves out by default: slide_fsdp_exact is slide_fsdp's code path with two knobs changed.
CPU_SKIPS = ("slide_fsdp_exact",)


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    raise RuntimeError("/proc/meminfo has no MemAvailable line; pass --host-memory-gb")


def gpu() -> tuple[str | None, float | None]:
    """The first GPU's name and memory in GiB from nvidia-smi (the bench's own process keeps CUDA uninitialised, so
    that no context of its own sits on the device beside the peers'); (None, None) where it does not answer."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
        name, mib = line.rsplit(",", 1)
        return name.strip(), float(mib) / 1024
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
        return None, None


def environment(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from /proc: torchrun starts each rank in a session of its own, which a signal
    to torchrun's process group does not reach."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):  # a process that ended while being read
            continue
        if state != "Z":
            children.setdefault(int(parent), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """``pid`` and every process below it: all stopped first, until a look finds none new (a stopped process starts
    no other, and none is re-parented out of reach while its parent lives), then all killed."""
    stopped: list[int] = []
    while new := [p for p in [pid, *descendants(pid)] if p not in stopped]:
        for target in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGSTOP)
            stopped.append(target)
    for target in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


def run_group(argv: list[str], folder: Path, timeout: float, extra_env: dict[str, str]) -> tuple[int | None, str]:
    """``argv`` with its output in ``folder/output.log``, killed with every process below it after ``timeout``
    seconds. Returns its exit status (None: timed out) and its output."""
    log = folder / "output.log"
    with open(log, "w") as sink:
        child = subprocess.Popen(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=environment(extra_env))
        try:
            rc: int | None = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(child.pid)
            child.wait()
            rc = None
    return rc, log.read_text(errors="replace")


def last_error(output: str, rc: int | None) -> str:
    """The error's first line from a run's output: a rank killed by a signal, else the last ``SomeError: ...`` line a
    traceback ended with (torchrun's own summary left out), else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if rc is not None and rc < 0:
        return f"killed by {signal.Signals(-rc).name} (out of host memory, or stopped from outside)"
    if any("Signal 9 (SIGKILL)" in line for line in lines):
        return "a rank was killed by SIGKILL (out of host memory, or stopped from outside)"
    raised = [line for line in lines if ": " in line and " " not in line.split(": ", 1)[0]
              and line.split(": ", 1)[0].endswith(("Error", "Exception")) and "ChildFailedError" not in line]
    if raised:
        return raised[-1]
    return lines[-1] if lines else f"exit code {rc}, no output"


def worker_run(peer: str, spec: dict[str, Any], folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A peer of ``peers_worker.py`` under torchrun, a process per rank; rank 0's record, or the failure."""
    (folder / "spec.json").write_text(json.dumps(spec))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.processes),
            str(ROOT / "scripts" / "peers_worker.py"), "--spec", str(folder / "spec.json"), "--out", str(folder)]
    # DeepSpeed detects a GPU by itself; without one its accelerator must be named (it builds its ops for it)
    extra = {"DS_ACCELERATOR": "cpu"} if args.device == "cpu" and peer.startswith("deepspeed") else {}
    rc, output = run_group(argv, folder, args.timeout, extra)
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    errors = [r["error"] for r in ranks if "error" in r]
    if rc is None:
        return {"status": "timeout", "error": f"timed out after {args.timeout:g} s"}
    if errors or rc != 0 or not ranks:
        return {"status": "failed", "error": errors[0] if errors else last_error(output, rc)}
    first = next(r for r in ranks if r["rank"] == 0)
    return {"status": "ok", **{k: first[k] for k in ("step_times_ms", "losses", "host_peak_rss_gib", "device_peak_gib",
                                                      "device_peak_reserved_gib", "versions")}}


def slide_fsdp_run(peer: str, spec: dict[str, Any], folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """SlideFSDP through ``python -m lit_fsdp fit`` with configs/llama_8b_offload.yaml and the spec laid over it;
    every step's time from ``callbacks.Throughput`` (no warm-up of its own: the bench leaves ``--warmup`` out)."""
    from lit_fsdp.commands.launch import launch

    adamw = spec["adamw"]
    callbacks = [{"class_path": "callbacks.Throughput", "init_args": {"warmup_steps": 0}},
                 {"class_path": "callbacks.Memory", "init_args": {"every_n_steps": 1}},
                 {"class_path": "callbacks.OffloadStats", "init_args": {"warmup_steps": args.warmup}},
                 {"class_path": "callbacks.Results", "init_args": {"run_name": f"bench_peers-{peer}"}}]
    strategy = dict(PEERS[peer].strategy)
    if args.host_memory_gb is not None and args.device == "cuda":
        strategy["host_memory_gb"] = args.host_memory_gb
    if args.device == "cpu":  # inductor's first compile takes minutes on 2 cores: the CPU mode is a code path check
        strategy["compile_blocks"] = False
    fit_args = [
        "--model.preset", spec["preset"], "--model.config_overrides", json.dumps({"num_hidden_layers": spec["layers"]}),
        "--model.learning_rate", str(adamw["lr"]), "--model.betas", json.dumps(adamw["betas"]),
        "--model.weight_decay", str(adamw["weight_decay"]), "--model.warmup_steps", "0", "--model.min_lr_ratio", "1.0",
        "--model.loss_chunk_tokens", str(spec["loss_chunk_tokens"]),
        "--data.vocab_size", str(spec["vocab_size"]), "--data.seq_len", str(spec["seq_len"]),
        "--data.batch_size", str(spec["batch_size"]),
        "--data.num_train_blocks", str(max(64, (spec["steps"] + 2) * spec["batch_size"] * args.processes)),
        "--data.num_val_blocks", "4",
        "--trainer.accelerator", "gpu" if args.device == "cuda" else "cpu", "--trainer.devices", str(args.processes),
        "--trainer.max_steps", str(spec["steps"]), "--trainer.limit_val_batches", "0",
        "--trainer.gradient_clip_val", str(adamw["clip"]), "--trainer.enable_checkpointing", "false",
        "--trainer.callbacks", json.dumps(callbacks), "--seed_everything", str(spec["seed"]),
        *[arg for key, value in strategy.items()
          for arg in (f"--trainer.strategy.init_args.{key}", json.dumps(value) if not isinstance(value, str) else value)],
    ]
    configs = [ROOT / "configs" / "quickstart.yaml", ROOT / "configs" / "llama_8b_offload.yaml"]
    outcome = launch(configs, fit_args, folder, timeout_s=args.timeout)
    if outcome["timed_out"]:
        return {"status": "timeout", "error": f"timed out after {args.timeout:g} s"}
    if outcome["status"] != "ok":
        output = (folder / "stderr.log").read_text(errors="replace")
        return {"status": "failed", "error": last_error(output, outcome["returncode"])}
    result = json.loads((folder / "results.jsonl").read_text().splitlines()[-1])
    times = json.loads((folder / "throughput.json").read_text())["step_times_ms"]
    environment = folder / "environment.json"  # callbacks.Results': the run's package versions
    versions = json.loads(environment.read_text()).get("packages", {}) if environment.is_file() else {}
    return {"status": "ok", "step_times_ms": times, "host_peak_rss_gib": result.get("peak_rss_gb"),
            "device_peak_gib": result.get("peak_allocated_gb"), "device_peak_reserved_gib": result.get("peak_reserved_gb"),
            "offload": {k: v for k, v in result.items() if k.startswith("offload_") and not isinstance(v, (dict, list))},
            "versions": versions}


def figures(run: dict[str, Any], shape: Shape, args: argparse.Namespace, device_name: str | None) -> dict[str, Any]:
    """Tokens/s and MFU over the steps after ``--warmup`` (each step device-synchronised, boundary to boundary)."""
    times = run["step_times_ms"]
    measured = times[args.warmup:]
    if not measured:
        return {"steps_measured": 0, "tokens_per_s": None, "mfu": None}
    tokens_per_s = args.tokens_per_step * len(measured) / (sum(measured) / 1000)
    peak = shape.peak_tflops(device_name) if args.device == "cuda" else None
    flops = shape.flops_per_token(args.seq_len)
    return {"steps_measured": len(measured), "tokens_per_s": tokens_per_s, "flops_per_token": flops,
            "peak_tflops": peak, "mfu": flops * tokens_per_s / args.processes / (peak * 1e12) if peak else None}


def run_peer(peer: str, shape: Shape, args: argparse.Namespace, host_gib: float, device: tuple[str | None, float | None]
             ) -> dict[str, Any]:
    """One row: refused up front, or run in its own process group; never an exception."""
    adamw = {"lr": args.lr, "betas": args.betas, "eps": EPS, "weight_decay": args.weight_decay, "clip": args.clip}
    spec = {"peer": peer, "device": args.device, "preset": shape.preset, "layers": shape.layers,
            "vocab_size": shape.vocab_size, "seq_len": args.seq_len, "batch_size": args.batch_size,
            "steps": args.steps, "seed": args.seed, "loss_chunk_tokens": args.loss_chunk_tokens, "adamw": adamw}
    record: dict[str, Any] = {
        "peer": peer, "device": args.device, "gpu": device[0], "preset": shape.preset, "layers": shape.layers,
        "shape": shape.dims(), "parameters": shape.parameters, "seq_len": args.seq_len, "processes": args.processes,
        "batch_size": args.batch_size, "tokens_per_step": args.tokens_per_step, "compute_dtype": "bfloat16",
        "adamw": adamw, "steps": args.steps, "warmup_steps_left_out": args.warmup, "host_memory_gib": host_gib,
        "host_needed_gib": PEERS[peer].host_gib(shape.parameters), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    why = refusal(PEERS[peer], shape.parameters, host_gib, device[1])
    if why is None and PEERS[peer].needs_deepspeed and not deepspeed_installed():
        record.update(status="failed", error="deepspeed is not installed; pip install -e '.[peers]'")
        return record
    if why is not None:
        record.update(status="refused", error=why)
        return record
    folder = args.work / f"{shape.preset}-{shape.layers}-{peer}"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("rank*.json"):
        stale.unlink()
    begin = time.perf_counter()
    runner = slide_fsdp_run if PEERS[peer].app else worker_run
    try:
        run = runner(peer, spec, folder, args)
    except Exception as error:  # the bench's own reading of a run's files: still a row
        run = {"status": "failed", "error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    record.update(run, wall_s=round(time.perf_counter() - begin, 1), folder=str(folder))
    if run["status"] == "ok":
        record.update(figures(run, shape, args, device[0]))
    return record


def deepspeed_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("deepspeed") is not None


def parse(argv: list[str] | None) -> argparse.Namespace:
    peers = "peers:\n" + "\n".join(f"  {name}: {peer.what}" for name, peer in PEERS.items())
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=peers,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: one GPU, one process; cpu: tiny sizes on 2 processes over gloo (every code path)")
    parser.add_argument("--preset", choices=("llama-8b", "llama-1b", "llama-tiny"),
                        help="the shape (lit_fsdp/presets.py; default llama-8b, llama-tiny on the CPU)")
    parser.add_argument("--layers", nargs="+", metavar="N",
                        help="blocks of the preset, one row set each; 'auto': the most every peer fits on this host "
                             "(default: all the preset's, then auto; 2 on the CPU)")
    parser.add_argument("--peers", nargs="+", choices=list(PEERS), metavar="PEER",
                        help=f"of {', '.join(PEERS)} (below); default: all (the CPU mode: all but {', '.join(CPU_SKIPS)})")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048; 64 on the CPU)")
    parser.add_argument("--batch-size", type=int, help="sequences per process and step, one micro-batch (default 32, "
                        "configs/llama_8b_offload.yaml's 65,536 tokens; 2 on the CPU)")
    parser.add_argument("--processes", type=int, help="processes (devices) per peer (default 1; 2 on the CPU)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run, --warmup included (default 7; 3 on the CPU)")
    parser.add_argument("--warmup", type=int, help="first steps left out of the rates (default 2; 1 on the CPU)")
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="AdamW's learning rate, constant (configs/llama_8b_offload.yaml's peak)")
    parser.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95], help="AdamW's betas (CausalLM's)")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="on matrices and embeddings, as CausalLM")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    parser.add_argument("--loss-chunk-tokens", type=int, default=1024,
                        help="the chunked loss head's chunk (CausalLM's default); 0: the plain loss")
    parser.add_argument("--seed", type=int, default=1234, help="the weights' and the token ids' seed")
    parser.add_argument("--host-memory-gb", type=float,
                        help="host memory the peers may count on, GiB (default: MemAvailable); SlideFSDP's host_memory_gb")
    parser.add_argument("--timeout", type=float, help="seconds per peer (default 900; 600 on the CPU, where DeepSpeed "
                        "builds its C++ ops at first use)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_peers.jsonl", help="JSON Lines, appended")
    parser.add_argument("--work", type=Path, help="the runs' folders (default: runs/bench_peers/ beside --out)")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    defaults = {"preset": "llama-tiny" if cpu else "llama-8b", "seq_len": 64 if cpu else 2048,
                "batch_size": 2 if cpu else 32, "processes": 2 if cpu else 1, "steps": 3 if cpu else 7,
                "warmup": 1 if cpu else 2, "timeout": 600.0 if cpu else 900.0,
                "peers": [p for p in PEERS if not (cpu and p in CPU_SKIPS)], "work": args.out.parent / "bench_peers"}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} with --steps {args.steps}: leave out fewer steps than the run has")
    for layers in args.layers or []:
        if layers != "auto" and not (layers.isdigit() and int(layers) >= 1):
            parser.error(f"--layers {layers}: give a number of blocks (1 or more) or auto")
    args.tokens_per_step = args.batch_size * args.seq_len * args.processes
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    host_gib = args.host_memory_gb if args.host_memory_gb is not None else mem_available_gib()
    device = gpu() if args.device == "cuda" else (None, None)
    full = Shape.of(args.preset, None).layers
    layers = args.layers or ([str(full), "auto"] if args.device == "cuda" else ["2"])
    shapes = []
    for value in layers:
        peers = [PEERS[name] for name in args.peers]
        count = auto_layers(args.preset, peers, host_gib, device[1]) if value == "auto" else int(value)
        if count is None:
            print(f"--layers auto: not one block of {args.preset} fits every peer in {host_gib:.1f} GiB of host memory")
            continue
        if count not in [s.layers for s in shapes]:
            shapes.append(Shape.of(args.preset, count))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{args.device}{' (' + device[0] + ')' if device[0] else ''}, {args.processes} process(es); "
          f"{args.tokens_per_step:,} tokens per step ({args.batch_size} x {args.seq_len} per process); host memory "
          f"{host_gib:.1f} GiB (a peer needs its host state + {HOST_RESERVE_GIB} GiB); {args.steps} steps, the first "
          f"{args.warmup} left out", flush=True)
    records = []
    for shape in shapes:
        for peer in args.peers:
            record = run_peer(peer, shape, args, host_gib, device)
            with args.out.open("a") as out:
                out.write(json.dumps(record, default=str) + "\n")
            records.append(record)
            print(table([record]).splitlines()[-1], flush=True)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
