"""Step time of every compression method across a slow link: two network namespaces, one rank in each.

Emulates two nodes on one machine: two Linux network namespaces joined by a veth pair (addresses
10.210.0.1/30 and 10.210.0.2/30, which exist only inside the namespaces), both veth ends shaped by a
``tc`` token-bucket filter (tbf) to the given rate, gloo over that link. The link is checked first
with a timed TCP transfer and its measured rate is printed. Then ``python -m lit_fsdp fit`` runs
once per method and rate with one rank in each namespace (Lightning's multi-node environment: 2 nodes
x 1 device), each rank pinned to its own core(s) with as many threads (``--threads``, default 1), so
its compute does not depend on the other rank's. The rows (rate, method) run in turns ``--repeats``
times (default 3): every row once, then every row again, so that a drift in the machine's load hits
every row alike; each rate has its own link, set up once for the whole sweep.

The configuration is communication-bound on purpose: ``sharding: NO_SHARD`` (the default) replicates
the model on both ranks (data parallelism across two nodes, as DDP), so the only traffic per step is
the gradient all-reduce across the link, which the compression hook compresses. ``--sharding
FULL_SHARD`` also all-gathers the parameters every step (twice: forward and backward); without
``--param-all-gather int8`` that traffic is uncompressed and caps the gain. PowerSGD's ``start_step`` and DGC's
``warmup_steps`` are set to 0, so the timed steps are compressed ones. The default model is GPT-2-shaped,
4 layers x 640 wide (about 20M parameters, 80 MB of fp32 gradients per step, about 0.65 s on
1 Gbit/s), trained on one sequence of 16 tokens per rank, so that most of a ``none`` step is the
fp32 exchange. The compressors run on the rank's own core(s) too: where their time per value
exceeds what the smaller payload saves on the wire, a method is slower than ``none`` (the codec
time is in the raw records, ``compress_time_ms`` and ``decompress_time_ms``). On a busy or small
CPU the veth pair itself may carry less than a high nominal rate: the table heading gives the
measured one.

Figures are read from each run's ``results.jsonl`` (``callbacks.Results``): a run's step time is the
p50 of its steps after warm-up; a row gives the median of its runs' p50s and their range (min-max).
Speed-up = median of ``none`` / median of the method at the same rate, with the range of the
per-repeat ratios (``none`` and the method of the same repeat). Communication time and share come
from ``callbacks.CommProfiler`` (when it exists) recording the same steps whose time is reported, so
those step times include the profiler's own per-op recording. Failed runs are counted in the row and
the sweep goes on. The table goes to ``OUT/table.md`` (rewritten after every run), every run's record
to ``OUT/results.jsonl`` (appended after every run), each run's folder to ``OUT/<rate>/<method>/<repeat>``
(rank logs included).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN, for ``ip netns`` and ``tc``); it removes the namespaces
it created (and with them the veth pair) on exit, on an error, on Ctrl-C and on SIGTERM.

    sudo python scripts/bench_slow_link.py                               # every method, 1 and 10 Gbit/s, 3 repeats
    sudo python scripts/bench_slow_link.py --rates 1gbit --methods none int8 --steps 8 --warmup 3 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from lit_fsdp.repeats import Spread, in_turns

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# Method name -> its config; `none` is the baseline (no hook: FSDP2's own fp32 all-reduce). The semi-synchronous
# configs (diloco, diloco_streaming) exchange every sync_every steps (``--sync-every``).
METHODS = {"none": CONFIGS / "baseline.yaml"} | {
    p.stem: p for p in sorted(CONFIGS.glob("*.yaml"))
    if ("compression:" in p.read_text() or "sync_every:" in p.read_text()) and p.stem != "baseline"
}
# The methods' dense warm-ups cut to what they cannot go below, so that the steps timed are compressed ones: PowerSGD's
# start_step and DGC's density warm-up to 0; 1-bit Adam's freeze and 0/1 Adam's variance freeze after the first step,
# and 0/1 Adam's periods doubling every round up to local_step_clipper (local rounds and a sync per period).
STEADY_STATE = {"start_step": "0", "warmup_steps": "0", "freeze_step": "1", "var_freeze_step": "1", "local_step_scaler": "1"}
# Environment that would make Lightning pick another cluster environment or another rank layout.
FOREIGN_ENV = ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
FOREIGN_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "LSB_", "TORCHELASTIC_")
VOCAB = 512  # the synthetic data's default vocabulary; the model's embedding follows it


class LinkError(RuntimeError):
    """Setting up the emulated link failed; the message is one line naming the command and its error."""

    def __init__(self, message: str, stderr: str | None = None):
        super().__init__(message)
        self.stderr = stderr  # the failed command's error output; None when the command did not run


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as ``1gbit``, ``500mbit``, ``100kbit``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r} is not a tc rate; use e.g. 1gbit, 10gbit, 500mbit")
    return float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]


def tc_rate(rate: str) -> str:
    """argparse type: a rate ``parse_rate`` reads, kept as tc spells it."""
    try:
        parse_rate(rate)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return rate


def _command(*argv: str) -> str:
    """Run an iproute2 command; its stdout, or LinkError with the command and its stderr."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise LinkError(f"`{argv[0]}` not found; install iproute2") from None
    if result.returncode != 0:
        stderr = result.stderr.strip() or f"exit {result.returncode}"
        raise LinkError(f"`{' '.join(argv)}` failed: {stderr}", stderr)
    return result.stdout


class SlowLink:
    """Two network namespaces joined by a rate-limited veth pair; removed again on exit.

    Names carry the pid, so concurrent benchmarks do not collide. SIGTERM and SIGHUP are turned into
    ``SystemExit`` while the link exists, so the teardown in ``__exit__`` runs for them as for Ctrl-C.
    """

    def __init__(self, rate: str, tag: str | None = None):
        tag = tag or str(os.getpid())
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        self.namespaces = (f"lit_fsdp-{tag}-0", f"lit_fsdp-{tag}-1")
        self.veths = (f"lfa{tag}"[:15], f"lfb{tag}"[:15])  # interface names: 15 characters at most
        self.addresses = ("10.210.0.1", "10.210.0.2")
        self._created: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
        self._handlers: dict[int, object] = {}

    def qdisc(self) -> list[str]:
        """The tc qdisc arguments for one veth end.

        tbf (token bucket) shapes the rate only, with no added delay or loss: what a slow link is for
        bulk transfers. Its bucket must hold at least one timer tick of traffic (rate / HZ; HZ=250
        is the coarsest common kernel tick) and a 64 KiB GSO packet, or the rate falls short; the
        queue holds 50 ms at the rate, so TCP sees queueing rather than drops.
        """
        burst = max(int(self.rate_bps / 8 / 250), 128 * 1024)
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "50ms"]

    def __enter__(self) -> SlowLink:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._handlers[signum] = signal.signal(signum, _exit_on_signal)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        for ns in self.namespaces:
            try:
                _command("ip", "netns", "add", ns)
            except LinkError as error:
                if error.stderr is None:  # no `ip` at all
                    raise
                if "exists" in error.stderr:  # not ours: it is left alone
                    raise LinkError(
                        f"network namespace {ns} already exists (left by a killed run?); remove it with `ip netns del {ns}`"
                    ) from None
                raise LinkError(
                    f"needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces; tried "
                    f"`ip netns add {ns}`: {error.stderr}; run it as root (sudo)"
                ) from None
            self._created.append(("netns", ns))
        a, b = self.veths
        _command("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        self._created.append(("link", a))
        for ns, veth, address in zip(self.namespaces, self.veths, self.addresses):
            _command("ip", "link", "set", veth, "netns", ns)
            _command("ip", "-n", ns, "addr", "add", f"{address}/30", "dev", veth)
            _command("ip", "-n", ns, "link", "set", "lo", "up")
            _command("ip", "-n", ns, "link", "set", veth, "up")
            _command("tc", "-n", ns, "qdisc", "add", "dev", veth, "root", *self.qdisc())
        self._created.remove(("link", a))  # each end now lives in a namespace and goes with it

    def close(self) -> None:
        """Delete what was created, newest first; safe to call twice. A namespace takes its veth with it."""
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            while self._created:
                kind, name = self._created.pop()
                command = ("ip", "netns", "del", name) if kind == "netns" else ("ip", "link", "del", name)
                try:
                    _command(*command)
                except LinkError as error:
                    print(f"bench_slow_link: could not remove {kind} {name}: {error}; remove it by hand", file=sys.stderr)
        finally:
            for signum, handler in {**previous, **self._handlers}.items():
                signal.signal(signum, handler)
            self._handlers.clear()

    def exec_prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program in node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node]]


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


# --- link check ----------------------------------------------------------------------------------


def probe_receive(port: int) -> None:
    """Receiver half of the link check (run inside node 1): count bytes to EOF, answer with the count."""
    with socket.create_server(("0.0.0.0", port)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        with connection:
            total = 0
            while chunk := connection.recv(1 << 20):
                total += len(chunk)
            connection.sendall(total.to_bytes(8, "big"))


def probe_send(address: str, port: int, nbytes: int) -> None:
    """Sender half (run inside node 0): time ``nbytes`` until the receiver has counted them all."""
    block = bytes(1 << 20)
    with socket.create_connection((address, port), timeout=60) as connection:
        start = time.perf_counter()
        for _ in range(0, nbytes, len(block)):
            connection.sendall(block)
        connection.shutdown(socket.SHUT_WR)
        answer = b""
        while len(answer) < 8 and (chunk := connection.recv(8 - len(answer))):
            answer += chunk
        seconds = time.perf_counter() - start
    print(json.dumps({"bytes": int.from_bytes(answer, "big"), "seconds": seconds}))


def measure_rate(link: SlowLink, seconds: float = 1.0, port: int = 5201) -> dict[str, float]:
    """Send about ``seconds`` worth of data at the nominal rate from node 0 to node 1; the measured rate."""
    nbytes = max(int(link.rate_bps / 8 * seconds), 16 << 20)
    script = [sys.executable, str(Path(__file__).resolve())]
    receiver = subprocess.Popen(
        [*link.exec_prefix(1), *script, "--probe-receive", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        if receiver.stdout.readline().strip() != "ready":
            raise LinkError(f"link check: the receiver in {link.namespaces[1]} did not start (exit {receiver.wait()})")
        sent = _command(*link.exec_prefix(0), *script, "--probe-send", link.addresses[1], str(port), str(nbytes))
        result = json.loads(sent)
        receiver.wait(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return {"measured_gbit_s": result["bytes"] * 8 / result["seconds"] / 1e9, **result}


# --- one run: a rank in each namespace -----------------------------------------------------------


def write_callbacks(path: Path, warmup: int, steps: int, profiler: bool) -> Path:
    """The measuring callbacks every run uses (they replace the method config's list).

    ``CommProfiler`` records the timed steps (those after ``warmup``), so the communication share is
    of the steps whose time is reported; its own start-up step is the last warm-up step.
    """
    callbacks = [
        {"class_path": "callbacks.CompressionStats"},
        {"class_path": "callbacks.Throughput", "init_args": {"warmup_steps": warmup}},
        {"class_path": "callbacks.Results"},
    ]
    if profiler and warmup >= 1:
        schedule = {"wait": warmup - 1, "warmup": 1, "active": steps - warmup}
        callbacks.insert(2, {"class_path": "callbacks.CommProfiler", "init_args": schedule})
    path.write_text(json.dumps({"trainer": {"callbacks": callbacks}}))
    return path


def fit_arguments(args: argparse.Namespace, method: str, callbacks: Path, run_dir: Path) -> list[str]:
    """``lit_fsdp fit`` arguments, the same on both nodes."""
    return [
        "-m", "lit_fsdp", "fit",
        "--config", str(METHODS[method]), "--config", str(callbacks),
        "--trainer.accelerator", "cpu", "--trainer.num_nodes", "2", "--trainer.devices", "1",
        "--trainer.strategy.init_args.sharding", args.sharding,
        *(["--trainer.strategy.init_args.compression.param_all_gather", args.param_all_gather]
          if args.param_all_gather else []),
        "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.logger", "false",
        "--trainer.default_root_dir", str(run_dir),
        "--model.config_overrides", json.dumps(model_overrides(args)),
        "--data.seq_len", str(args.seq_len), "--data.batch_size", str(args.batch_size),
        "--data.num_train_blocks", str(args.batch_size * 2 * (args.steps + 1)),
        *steady_state(method),
        *(["--trainer.strategy.init_args.sync_every", str(args.sync_every)]
          if args.sync_every and "sync_every:" in METHODS[method].read_text() else []),
    ]


def steady_state(method: str) -> list[str]:
    """Arguments that turn ``method``'s dense warm-up steps off, so that its measured steps are compressed ones."""
    config = yaml.safe_load(METHODS[method].read_text())
    compression = config["trainer"]["strategy"]["init_args"].get("compression") or {}
    return [arg for key, value in STEADY_STATE.items() if key in compression
            for arg in (f"--trainer.strategy.init_args.compression.{key}", value)]


def model_overrides(args: argparse.Namespace) -> dict[str, int]:
    return {"n_layer": args.layers, "n_embd": args.width, "n_head": args.heads}


def rank_launch(
    link: SlowLink, node: int, fit_args: list[str], port: int, cores: list[int]
) -> tuple[list[str], dict[str, str]]:
    """Command and environment of the rank on ``node``: Lightning's multi-node variables, gloo on the veth.

    ``LOCAL_RANK`` tells Lightning's default environment that the processes are launched outside it,
    so it starts none itself; the world size comes from ``num_nodes x devices``. Each rank is pinned
    to its own half of ``cores`` with as many threads, so its compute does not compete with the other's.
    """
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV and not k.startswith(FOREIGN_PREFIXES)}
    threads = max(1, len(cores) // 2)
    env.update(
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        MASTER_ADDR=link.addresses[0], MASTER_PORT=str(port), NODE_RANK=str(node), LOCAL_RANK="0",
        GLOO_SOCKET_IFNAME=link.veths[node], OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
    )
    mine = cores[node * threads : (node + 1) * threads] or cores[-threads:]  # one core: both ranks share it
    pin = ",".join(map(str, mine))
    return [*link.exec_prefix(node), "taskset", "-c", pin, sys.executable, *fit_args], env


def run_ranks(launches: list[tuple[list[str], dict[str, str]]], logs: list[Path], timeout: float) -> str | None:
    """Start every rank, wait for all; None on success, else why it failed.

    When one rank fails the other would wait on a collective until gloo's timeout, so it is killed
    at once; on timeout, error or Ctrl-C every rank still running is killed (its whole process group).
    """
    processes: list[subprocess.Popen] = []
    try:
        for (argv, env), log in zip(launches, logs):
            with open(log, "w") as out:
                processes.append(subprocess.Popen(
                    argv, env=env, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                ))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in processes]
            for code, log in zip(codes, logs):
                if code not in (None, 0):
                    return f"{log.stem} exited {code}: {last_line(log)}"
            if all(code == 0 for code in codes):
                return None
            if time.monotonic() > deadline:
                return f"timed out after {timeout:.0f} s"
            time.sleep(0.5)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def run_method(link: SlowLink, method: str, repeat: int, args: argparse.Namespace, callbacks: Path, port: int) -> dict:
    """One fit across the link; the run's results record, or ``{"failed": reason}``, with its rate, method and repeat."""
    run_dir = args.out / link.rate / method / str(repeat)
    run_dir.mkdir(parents=True, exist_ok=True)
    results = run_dir / "results.jsonl"
    before = len(results.read_text().splitlines()) if results.exists() else 0
    fit_args = fit_arguments(args, method, callbacks, run_dir)
    cores = sorted(os.sched_getaffinity(0))[: 2 * args.threads]
    launches = [rank_launch(link, node, fit_args, port, cores) for node in (0, 1)]
    start = time.perf_counter()
    failure = run_ranks(launches, [run_dir / "rank0.log", run_dir / "rank1.log"], args.timeout)
    base = {"rate": link.rate, "method": method, "repeat": repeat, "wall_s": round(time.perf_counter() - start, 1)}
    if failure is None:
        lines = results.read_text().splitlines() if results.exists() else []
        if len(lines) > before:
            return {**base, **json.loads(lines[-1])}
        failure = f"no new record in {results}"
    return {**base, "failed": failure}


# --- report --------------------------------------------------------------------------------------


def _cell(spread: Spread | None, spec: str = ".0f", suffix: str = "") -> str:
    return "n/a" if spread is None else spread.format(spec, suffix)


def table(records: list[dict], rate: str, statistic: str = "p50") -> str:
    """Markdown for one rate: a row per method over its repeats, speed-up against ``none`` from the medians of each
    run's ``statistic`` step time (``mean`` counts a semi-synchronous method's rare exchange steps)."""
    key = f"step_time_ms_{statistic}"
    runs: dict[str, list[dict]] = {}
    for r in records:
        if r["rate"] == rate:
            runs.setdefault(r["method"], []).append(r)
    base = {r["repeat"]: r[key] for r in runs.get("none", []) if r.get(key)}
    base_step = Spread.of(base.values())
    lines = [
        f"| method | runs | step ms {statistic} | speed-up vs none | comm ms/step | comm share | compression ratio "
        "| outer exchange hidden |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, rows in runs.items():
        done = [r for r in rows if "failed" not in r]
        failed = [r["failed"][:120].replace("|", "/") for r in rows if "failed" in r]
        count = f"{len(done)} of {len(rows)}" + (f"; failed: {failed[-1]}" if failed else "")
        step = Spread.of(r.get(key) for r in done)
        speedup = None
        paired = [base[r["repeat"]] / r[key] for r in done if r.get(key) and r["repeat"] in base]
        if base_step and step and paired:  # the ratio of the medians, with the range of the per-repeat ratios
            speedup = Spread(base_step.median / step.median, min(paired), max(paired), len(paired))
        share = Spread.of(None if r.get("comm_ratio") is None else 100 * r["comm_ratio"] for r in done)
        ratio = Spread.of(r.get("compression_ratio") for r in done)
        hidden = Spread.of(None if not r.get("outer_syncs") else 100 * (r.get("outer_hidden_share") or 0) for r in done)
        lines.append(
            f"| {method} | {count} | {_cell(step)} | {_cell(speedup, '.2f', 'x')} "
            f"| {_cell(Spread.of(r.get('comm_time_ms_total') for r in done))} | {_cell(share, '.0f', '%')} "
            f"| {'n/a' if ratio is None else f'{ratio.median:.1f}x'} | {_cell(hidden, '.0f', '%')} |"
        )
    return "\n".join(lines)


def parameter_count(args: argparse.Namespace) -> int:
    """Parameters of the benchmark model (built on the meta device: nothing is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_fsdp.presets import build_config

    with torch.device("meta"):
        config = build_config("gpt2-tiny", {**model_overrides(args), "vocab_size": VOCAB})
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def comm_profiler_available() -> bool:
    """Whether ``callbacks.CommProfiler`` exists (it gives the communication share)."""
    try:
        return hasattr(importlib.import_module("callbacks"), "CommProfiler")
    except Exception as error:  # a broken callbacks package is reported by the runs themselves
        print(f"bench_slow_link: callbacks not importable ({error}); running without CommProfiler", file=sys.stderr)
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=list(METHODS), metavar="METHOD",
        help=f"methods to run (default: all): {', '.join(METHODS)}",
    )
    parser.add_argument("--rates", nargs="+", type=tc_rate, default=["1gbit", "10gbit"], help="tc rates, e.g. 1gbit 500mbit")
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    parser.add_argument("--sharding", choices=["NO_SHARD", "FULL_SHARD"], default="NO_SHARD",
                        help="NO_SHARD: the gradient all-reduce is the only traffic; FULL_SHARD: parameter all-gathers "
                             "and gradient reduce-scatters cross the link")
    parser.add_argument("--param-all-gather", choices=["int8", "fp8", "bf16", "fp16"],
                        help="FULL_SHARD: quantise the parameter all-gather too (compression.param_all_gather)")
    parser.add_argument(
        "--warmup", type=int, default=5, help="first steps left out of the step times and the profile"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of every (rate, method) row, in turns")
    parser.add_argument("--sync-every", type=int, help="the semi-synchronous methods' sync_every (default: their config's)")
    parser.add_argument("--statistic", choices=["p50", "mean"], default="p50",
                        help="each run's step time: p50, or mean (which counts a semi-synchronous method's exchange "
                             "steps; time a whole number of its periods after --warmup)")
    parser.add_argument("--layers", type=int, default=4, help="GPT-2 n_layer")
    parser.add_argument("--width", type=int, default=640, help="GPT-2 n_embd")
    parser.add_argument("--heads", type=int, default=8, help="GPT-2 n_head")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=1, help="per rank")
    parser.add_argument("--threads", type=int, default=1, help="cores (and threads) per rank, each rank on its own")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take before both ranks are killed")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_slow_link", help="table, records and run folders")
    parser.add_argument("--probe-receive", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--probe-send", nargs=3, metavar=("ADDRESS", "PORT", "BYTES"), help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.probe_receive is not None:
        return probe_receive(args.probe_receive)
    if args.probe_send is not None:
        return probe_send(args.probe_send[0], int(args.probe_send[1]), int(args.probe_send[2]))
    if args.param_all_gather and args.sharding == "NO_SHARD":
        parser.error("--param-all-gather needs --sharding FULL_SHARD (NO_SHARD gathers no parameters)")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1")
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no measured step of --steps {args.steps}; lower it")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    rates = list(dict.fromkeys(args.rates))
    records: list[dict] = []
    port = 29500
    try:
        with contextlib.ExitStack() as stack:
            # Every link first: a missing root fails before anything slow.
            links = {rate: stack.enter_context(SlowLink(rate, tag=f"{os.getpid()}{i}")) for i, rate in enumerate(rates)}
            params = parameter_count(args)
            callbacks = write_callbacks(args.out / "callbacks.json", args.warmup, args.steps, comm_profiler_available())
            setup = (
                f"{args.sharding}{' with a ' + args.param_all_gather + ' parameter all-gather' if args.param_all_gather else ''} across 2 namespaces (1 rank each, gloo, {args.threads} pinned core(s) and "
                f"thread(s) per rank); GPT-2 "
                f"n_layer={args.layers} n_embd={args.width} ({params / 1e6:.1f}M parameters, "
                f"{4 * params / 1e6:.0f} MB of fp32 gradients per step), batch {args.batch_size} x seq "
                f"{args.seq_len} per rank, synthetic data; {args.steps} steps, first {args.warmup} left out; "
                f"{args.repeats} repeat(s), every row once per repeat"
            )
            print(setup, flush=True)
            checks, headings = {}, {}
            for rate in rates:
                check = checks[rate] = measure_rate(links[rate])
                fp32_ms = 4 * params * 8 / (check["measured_gbit_s"] * 1e9) * 1000
                headings[rate] = (
                    f"## {rate}: measured {check['measured_gbit_s']:.2f} Gbit/s "
                    f"(tbf on both veth ends); the fp32 all-reduce alone takes about {fp32_ms:.0f} ms per step"
                )
                print(headings[rate], flush=True)
            for repeat, (rate, method) in in_turns([(r, m) for r in rates for m in args.methods], args.repeats):
                port += 1  # a fresh port: the last run's may still be in TIME_WAIT
                record = {**run_method(links[rate], method, repeat, args, callbacks, port), "link": checks[rate],
                          "setup": setup, "sharding": args.sharding, "param_all_gather": args.param_all_gather}
                records.append(record)
                print(json.dumps({k: record.get(k) for k in (
                    "rate", "method", "repeat", "wall_s", "failed", "step_time_ms_p50", "comm_ratio",
                    "compression_ratio")}), flush=True)
                with open(args.out / "results.jsonl", "a") as f:
                    f.write(json.dumps(record, default=str) + "\n")
                # Rewritten after every run, so an interrupted sweep keeps the table of the runs done so far.
                markdown = report(setup, headings, records, args.statistic)
                (args.out / "table.md").write_text(markdown + "\n")
    except LinkError as error:
        sys.exit(f"bench_slow_link: {error}")
    print(markdown)


def report(setup: str, headings: dict[str, str], records: list[dict], statistic: str = "p50") -> str:
    """The setup, the legend and a table per rate that has runs."""
    legend = (
        f"Step ms {statistic}: each run's {statistic} over its timed steps; the median over the repeats (min-max in brackets). "
        "Speed-up vs none: median of none / median of the method (min-max of the per-repeat ratios in brackets). "
        "Comm ms/step and comm share: CommProfiler over the same timed steps (whose times include its recording). "
        "Outer exchange hidden: the share of a semi-synchronous method's exchange time its inner steps hid."
    )
    sections = [f"{heading}\n\n{table(records, rate, statistic)}" for rate, heading in headings.items()
                if any(r["rate"] == rate for r in records)]
    return "\n\n".join([setup, legend, *sections])


if __name__ == "__main__":
    main()
