"""The GPU check: one command that turns a short window on one GPU into measured figures, each beside its estimate.

    python scripts/gpu_check.py --out gpu_out                     # the default plan, within --budget seconds
    python scripts/gpu_check.py --out gpu_out --steps slide_fsdp  # other steps, or continue where a window stopped
    python scripts/gpu_check.py --device cpu --out /tmp/check     # tiny sizes, every step's code path (CI)

Each step runs in its own process group under its own deadline (the smaller of the step's and what is left of
the budget): a step that runs out of time is reported as ``timeout`` with what it recorded so far, and the
next one runs. Every rate leaves out the first ``--warmup-steps`` optimizer steps of its run, and the records and
the tables say how many. Before every training run, ``estimate``'s JSON for its configs is written with the
probe's ``hardware.json``. Written under ``--out``, few files so a device window can bring them back:
``summary.json`` (every step's record), ``check.log`` (every step's output), ``hardware.json`` (the probe's
measured rates in the ``--tune.hardware`` format), ``estimate.json`` (every run's estimate, by run name), and two
short tables printed last: the training runs' rates, then the steps.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
_PACKAGES = ("torch", "lightning", "transformers", "huggingface_hub", "tokenizers", "safetensors", "torchmetrics",
             "jsonargparse", "docstring_parser", "typeshed_client", "ijson", "wandb", "numpy", "triton", "pytest")


# --- records ---------------------------------------------------------------------------------------


class Record(dict):
    """A step's record, written to ``<work>/<step>.json`` after every update so a killed step still reports."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def put(self, **values: Any) -> None:
        self.update(values)
        self.path.write_text(json.dumps(self, indent=1, default=str))


def _median_ms(run: Callable[[], None], repeats: int, device: str) -> float:
    """Median wall time of ``run`` in ms: CUDA events on a GPU, a synchronised host clock otherwise."""
    import torch

    run()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            run()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


# --- step 0: probe ---------------------------------------------------------------------------------


def _versions() -> dict[str, str | None]:
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _meminfo() -> dict[str, float]:
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable", "MemFree", "Hugepagesize"):
            values[f"{key}_gib"] = round(int(rest.split()[0]) * 1024 / GIB, 2)
    return values


def _cpu_view(device: str) -> dict[str, Any]:
    """Cores as SlideFSDP's CPU binding sees them, and the update threads it would use (``offload.cpu_binding``)."""
    from offload.cpu_binding import numa_node_of, pci_address, physical_cores, plan_binding
    from offload.preflight import describe_cores, update_threads

    allowed = os.sched_getaffinity(0)
    quota = None
    try:
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        quota = None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        pass
    view: dict[str, Any] = {"cpu_count": os.cpu_count(), "allowed": len(allowed), "cgroup_quota": quota,
                            "physical_cores": len(physical_cores(set(allowed)))}
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    view["numa_nodes"] = len(nodes)
    if device == "cuda":
        pci = pci_address(0)
        binding = plan_binding(0, [pci], set(allowed), control_cores=1)
        threads = min(update_threads(1), binding.threads)  # what SlideFSDP's plan_update_threads takes, one rank
        view.update(gpu_pci=pci, gpu_numa_node=numa_node_of(pci), update_threads=threads,
                    update_threads_reason=f"{threads} update threads: {describe_cores()}; one core left to launching "
                                          f"kernels; bound to {binding.describe()}")
    return view


def _registration(record: Record) -> None:
    """Register 8 GiB in place, then the same memory again (the failure path): the error is cleared, CUDA still works."""
    import torch

    from offload.host import register_host_memory

    size = 8 * GIB
    host = torch.empty(size, dtype=torch.uint8)
    host.fill_(1)  # touch every page first, as SlideFSDP's buffers are before they are registered
    begin = time.perf_counter()
    first = register_host_memory(host, size)
    seconds = time.perf_counter() - begin
    try:
        second = register_host_memory(host, size)  # already registered: must fail, be cleared and warn
    except RuntimeError as error:  # no way to clear the error on this torch: the fix is named
        second, record["register_again_error"] = True, str(error)
    probe = torch.ones(1024, device="cuda") * 2
    torch.cuda.synchronize()
    still_works = bool(probe.sum().item() == 2048)
    if first:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    record.put(register_gib=8, register_ok=first, register_s=round(seconds, 3), register_again_refused=not second,
               cuda_works_after_failed_register=still_works)


def _bandwidths(record: Record, device: str) -> dict[str, float]:
    import torch

    from offload.host import register_host_memory

    rates: dict[str, float] = {}
    size = (2 * GIB) if device == "cuda" else (64 << 20)
    if device == "cuda":
        gpu = torch.empty(size, dtype=torch.uint8, device="cuda")
        pageable = torch.empty(size, dtype=torch.uint8).fill_(3)
        registered = torch.empty(size, dtype=torch.uint8).fill_(5)
        pinned = register_host_memory(registered, size)
        for name, host in (("registered", registered), ("pageable", pageable)):
            rates[f"h2d_{name}_gbps"] = size / _median_ms(lambda: gpu.copy_(host, non_blocking=True), 5, device) / 1e6
            rates[f"d2h_{name}_gbps"] = size / _median_ms(lambda: host.copy_(gpu, non_blocking=True), 5, device) / 1e6
        if pinned:
            torch.cuda.cudart().cudaHostUnregister(registered.data_ptr())
        other = torch.empty_like(gpu)
        rates["device_copy_tbps"] = 2 * size / _median_ms(lambda: other.copy_(gpu), 10, device) / 1e9
        del gpu, other, pageable, registered
        n = 8192
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        rates["gemm_bf16_tflops"] = 2 * n**3 / _median_ms(lambda: a @ b, 10, device) / 1e9
        a32, b32 = a.float(), b.float()
        rates["gemm_fp32_tflops"] = 2 * n**3 / _median_ms(lambda: a32 @ b32, 5, device) / 1e9
        del a, b, a32, b32
        torch.cuda.empty_cache()
    host_size = (4 * GIB) if device == "cuda" else (256 << 20)
    source = torch.empty(host_size // 4, dtype=torch.float32).fill_(1.5)
    target = torch.empty_like(source)
    rates["host_copy_gbps"] = 2 * host_size / _median_ms(lambda: target.copy_(source), 5, "cpu") / 1e6
    if device == "cpu":
        n = 1024
        a, b = torch.randn(n, n), torch.randn(n, n)
        rates["gemm_fp32_tflops"] = 2 * n**3 / _median_ms(lambda: a @ b, 5, device) / 1e9
    rates = {key: round(value, 3) for key, value in rates.items()}
    record.put(**rates)
    return rates


def _update_rate(record: Record, device: str, work: Path) -> dict[str, float]:
    """GB/s of SlideFSDP's CPU update on this host (the native kernel, its threads the cores less one, as the 8B run's):
    ``scripts/bench_cpu_update.py``'s rows with float32 and bfloat16 moments, bfloat16 gradients."""
    threads = max(1, (os.cpu_count() or 2) - 1)
    out = work / "bench_cpu_update.jsonl"
    out.unlink(missing_ok=True)
    _command("cpu_update", [sys.executable, "scripts/bench_cpu_update.py", "--numel", str(2**27 if device == "cuda" else 2**22),
                            "--threads", str(threads), "--repeats", "2", "--paths", "native", "--out", str(out)],
             work, record)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    rates = {f"cpu_update_{row['optimizer_state_dtype']}_moments_gbps": round(row["gbps"], 1)
             for row in rows if row["gradient_dtype"] == "bfloat16"}
    rates["cpu_update_copy_gbps"] = round(rows[0]["copy_gb_per_s"], 1)
    record.put(cpu_update_threads=threads, **rates)
    return rates


def _model_efficiency(record: Record, peak_tflops: float) -> float:
    """The share of ``peak_tflops`` (bfloat16) the forward and backward of a Llama-8B-shaped model reach on this GPU:
    two of its blocks with the embeddings and head, every block checkpointed, 4 x 2048 tokens, timed over three steps
    against the FLOPs ``lit_fsdp.flops`` counts for them (``estimate``'s ``compute_efficiency``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_fsdp.flops import flops_per_token, recompute_flops_per_token
    from lit_fsdp.presets import build_config

    config = build_config("llama-8b", {"vocab_size": 128256, "num_hidden_layers": 2})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.train()
    tokens = torch.randint(0, config.vocab_size, (4, 2048), device="cuda")

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()

    seconds = _median_ms(step, 3, "cuda") / 1e3
    flops = tokens.numel() * (flops_per_token(config, 2048) + recompute_flops_per_token(config, 2048, 1))
    efficiency = flops / seconds / (peak_tflops * 1e12)
    record.put(model_step_s=round(seconds, 4), model_tflops=round(flops / seconds / 1e12, 1),
               compute_efficiency=round(efficiency, 3))
    del model
    torch.cuda.empty_cache()
    return efficiency


def step_probe(record: Record, device: str, work: Path) -> None:
    """Versions, the device, host memory, cores; a large registration and its failure path; measured rates."""
    import torch

    record.put(python=sys.version.split()[0], kernel=os.uname().release, versions=_versions(), torch_cuda=torch.version.cuda,
               torch_cuda_available=torch.cuda.is_available(), **_meminfo())
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,"
             "temperature.gpu", "--format=csv,noheader"], capture_output=True, text=True)
        record.put(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 2), sms=props.multi_processor_count,
                   l2_mb=round(getattr(props, "L2_cache_size", 0) / 1e6, 1), nvidia_smi=smi.stdout.strip() or smi.stderr.strip(),
                   cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    record.put(cpu=_cpu_view(device))
    if device == "cuda":
        _registration(record)
    rates = _bandwidths(record, device)
    from dataclasses import asdict

    from lit_fsdp.commands.tune.hardware import detect

    hardware = asdict(detect())
    update = _update_rate(record, device, work)
    # estimate's rates: the update's own (bfloat16 moments, as the 8B config ships), the copies', and on a GPU the
    # share of the measured GEMM peak a transformer's forward and backward reach
    hardware["host_memory_gbps"] = update.get("cpu_update_bfloat16_moments_gbps") or round(rates["host_copy_gbps"], 1)
    if device == "cuda":
        hardware["pcie_gbps"] = round(min(rates["h2d_registered_gbps"], rates["d2h_registered_gbps"]), 1)
        hardware["peak_tflops"] = {**hardware["peak_tflops"], "bf16": round(rates["gemm_bf16_tflops"], 1)}
        hardware["compute_efficiency"] = round(min(1.0, _model_efficiency(record, rates["gemm_bf16_tflops"])), 3)
    (work / "hardware.json").write_text(json.dumps(hardware, indent=2) + "\n")
    record.put(hardware=hardware)


# --- step 1: the tests that skip without CUDA --------------------------------------------------------


def _environment() -> dict[str, str]:
    """The children's environment: the checkout importable (scripts run as files; the project need not be installed)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def _command(name: str, command: list[str], work: Path, record: Record) -> list[str]:
    """Run ``command`` in the checkout, its output streamed to a file (a command that hangs still shows where) and
    then printed; the record gets its exit status and last line. Returns its output lines."""
    print("$", " ".join(command), flush=True)
    output = work / f"{name}.txt"
    with open(output, "w") as sink:
        done = subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=_environment())
    lines = [line for line in output.read_text().splitlines() if line.strip()]
    print("\n".join(lines[-200:]), flush=True)
    record.put(rc=done.returncode, result=lines[-1] if lines else "")
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {Path(command[1]).name if command[1] != '-m' else command[2]} exited {done.returncode}")
    return lines


CUDA_TESTS = ["tests/test_quantizers.py", "tests/test_sparsifiers.py", "tests/test_generate_and_evaluate.py"]


def step_cuda_tests(record: Record, device: str, work: Path) -> None:
    """The tests that skip without CUDA: codec round trips on the device, generate/evaluate CPU against GPU."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "-k", "cuda", *CUDA_TESTS]
    try:
        _command("cuda_tests", command + (["-n", "4"] if device == "cuda" else []), work, record)
    finally:
        lines = (work / "cuda_tests.txt").read_text().splitlines()
        record.put(failed=[line for line in lines if line.startswith(("FAILED", "ERROR"))][:30])


# --- steps 2-4: training runs through the CLI ----------------------------------------------------------


def _yaml(path: Path, data: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _losses(folder: Path) -> dict[int, float]:
    """Per-step training losses from the CSV logger's file (flushed every step)."""
    losses: dict[int, float] = {}
    for metrics in sorted((folder / "csv").glob("*/metrics.csv")):
        try:
            rows = list(csv.DictReader(metrics.open()))
        except (OSError, csv.Error):
            continue
        losses.update({int(row["step"]): float(row["train/loss"]) for row in rows if row.get("train/loss")})
    return losses


#: Optimizer steps left out of every rate by default: allocation and first touch, and the delayed update's first step,
#: which has no update to overlap.
WARMUP_STEPS = 2
WARMUP_VARIABLE = "GPU_CHECK_WARMUP_STEPS"  # --warmup-steps, handed to the steps' processes
HOST_MEMORY_VARIABLE = "GPU_CHECK_HOST_MEMORY_GB"  # --host-memory-gb, handed to the steps' processes


def _warmup_steps() -> int:
    return int(os.environ.get(WARMUP_VARIABLE, WARMUP_STEPS))


def _measuring(offload: bool, extra: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """A measured run's callbacks: ``extra`` first, then the rates with the first ``--warmup-steps`` left out
    (Throughput, and OffloadStats under SlideFSDP), peaks, and the results record last (it reads the others)."""
    warmup = {"init_args": {"warmup_steps": _warmup_steps()}}
    offload_stats = [{"class_path": "callbacks.OffloadStats", **warmup}] if offload else []
    return [*extra, {"class_path": "callbacks.Throughput", **warmup}, {"class_path": "callbacks.Memory"}, *offload_stats,
            {"class_path": "callbacks.Results"}]


def _estimate(name: str, work: Path, fit_args: list[str]) -> dict[str, Any]:
    """``estimate``'s JSON for a run's configs, with the probe's ``hardware.json`` (this machine, detected, where
    the probe has not run), written to ``<work>/<name>.estimate.json`` before the run starts; the figures the run is
    compared with are returned (or the error: an estimate that fails does not stop the measurement)."""
    from lit_fsdp.commands.estimate import estimate_step, parse
    from lit_fsdp.commands.tune.hardware import load

    hardware = work / "hardware.json"
    try:
        trainer, module, data = parse(fit_args, load(hardware) if hardware.is_file() else None)
        figures = estimate_step(trainer, module, data, trainer.hardware)
    except (Exception, SystemExit) as error:  # jsonargparse exits on a config it refuses
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    path = work / f"{name}.estimate.json"
    path.write_text(json.dumps(figures, indent=2) + "\n")  # what `python -m lit_fsdp estimate --json` prints
    return {"file": path.name, "hardware": hardware.name if hardware.is_file() else "detected",
            "step_time_s": figures["step_time_s"], "mfu": figures["mfu"],
            "cpu_update_bytes": figures["cpu_update_bytes"],
            "device_peak_gib": figures["device_peak_bytes"] / GIB, "host_gib": figures["host_bytes"] / GIB,
            "fits": figures["fits"]}


def _fit(name: str, work: Path, configs: list[str], record: Record, steps: int, min_free_gib: float = 4.0,
         checkpoints: bool = False, ckpt_path: str | None = None, folder: Path | None = None,
         measure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One ``python -m lit_fsdp fit`` run in ``folder`` (default: work/name): CSV logger (W&B may be missing), no
    validation, no checkpoints unless asked (a config then names its ModelCheckpoint), a loss per step. A run given
    ``measure`` (its callbacks, from ``_measuring``) runs ``--warmup-steps`` more steps than ``steps``, left out of
    every rate. ``estimate``'s JSON for its configs is written first (``_estimate``). While it runs, its progress
    (set-up time, steps done, steps/s after the warm-up) goes into the record every few seconds, so a step cut by its
    deadline still says how far it got; a watchdog ends it before the host runs out of memory (MemAvailable under
    ``min_free_gib``). Returns its record: results.jsonl's line, per-step losses and ``figures`` (``_figures``)."""
    folder = folder or work / name
    warmup = _warmup_steps() if measure is not None else 0
    trainer = {
        "max_steps": warmup + steps, "limit_val_batches": 0, "enable_checkpointing": checkpoints,
        "enable_progress_bar": False, "log_every_n_steps": 1, "default_root_dir": str(folder),
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                   "init_args": {"save_dir": str(folder), "name": "csv", "flush_logs_every_n_steps": 1}},
        **({"callbacks": measure} if measure is not None else {}),
    }
    override = _yaml(work / f"{name}.yaml", {"trainer": trainer})
    fit_args = [*[a for c in configs for a in ("--config", c)], "--config", str(override)]
    run: dict[str, Any] = {"rc": None, "losses": [], "estimate": _estimate(name, work, fit_args)}
    if measure is not None:
        run["warmup_steps_left_out"] = warmup
    record.put(**{name: run})
    command = [sys.executable, "-m", "lit_fsdp", "fit", *fit_args] + (["--ckpt_path", ckpt_path] if ckpt_path else [])
    print("$", " ".join(command), flush=True)
    begin = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, stdout=sys.stdout, stderr=subprocess.STDOUT, start_new_session=True,
                             env=_environment())
    first_step_at = steady_from = None
    while child.poll() is None:
        time.sleep(2)
        losses = _losses(folder)
        now = time.perf_counter() - begin
        if losses and first_step_at is None:
            first_step_at = now
        if steady_from is None and len(losses) >= max(warmup, 1):  # the steps/s below leave the warm-up out too
            steady_from = (now, len(losses))
        run.update(wall_s=round(now, 1), steps_done=len(losses), first_step_s=first_step_at and round(first_step_at, 1),
                   min_mem_available_gib=min(run.get("min_mem_available_gib", 1e9), _meminfo()["MemAvailable_gib"]))
        if steady_from is not None and len(losses) > steady_from[1]:
            run["steps_per_s"] = round((len(losses) - steady_from[1]) / max(now - steady_from[0], 1e-9), 3)
        record.put(**{name: run})
        if run["min_mem_available_gib"] < min_free_gib:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            run["stopped"] = f"watchdog: MemAvailable {run['min_mem_available_gib']} GiB < {min_free_gib}"
            break
    results = folder / "results.jsonl"
    losses = _losses(folder)
    run.update(rc=child.returncode, wall_s=round(time.perf_counter() - begin, 1), steps_done=len(losses),
               result=json.loads(results.read_text().splitlines()[-1]) if results.is_file() else {},
               losses=[losses[k] for k in sorted(losses)])
    if measure is not None:
        run["figures"] = _figures(run)
    record.put(**{name: run})
    if child.returncode != 0:
        raise RuntimeError(f"{name}: fit exited {child.returncode}" + (f" ({run['stopped']})" if "stopped" in run else ""))
    return run


def _figures(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of a measured run that the records' summaries and the tables show: results.jsonl's rates (the
    warm-up left out), peaks and offload figures, the lowest MemAvailable, and the CPU update's GB/s: the bytes
    ``estimate`` counts for it over its measured time (absent where either is)."""
    result, estimate = run.get("result", {}), run.get("estimate", {})
    keys = ("tokens_per_s", "mfu", "steps_measured", "warmup_steps_included", "step_time_ms_mean", "step_time_ms_p50",
            "peak_allocated_gb", "peak_reserved_gb", "train_loss")
    figures = {key: value for key, value in result.items()
               if key in keys or key.startswith(("offload_", "host_", "memory_", "perf_", "mfu", "tokens"))}
    figures.update(warmup_steps_left_out=run.get("warmup_steps_left_out"),
                   min_mem_available_gib=run.get("min_mem_available_gib"))
    update_ms, update_bytes = result.get("offload_cpu_update_ms"), estimate.get("cpu_update_bytes")
    if update_ms and update_bytes:
        figures["offload_cpu_update_gbps"] = update_bytes / 1e9 / (update_ms / 1e3)
    if estimate.get("step_time_s") is not None:
        figures["estimate_step_time_s"] = estimate["step_time_s"]
    return figures


def _offload_strategy(device: str, dtype: str, **knobs: Any) -> dict[str, Any]:
    init = {"window": 2, "param_transfer": "full", "grad_sync": "gpu_reduce", "param_dtype": dtype, "reduce_dtype": "auto",
            "activation_checkpointing": 1, "activation_offload": "cpu", **knobs}
    if device == "cuda":
        # The VM's memory is granted as it is used: MemAvailable starts far below what it gets (--host-memory-gb).
        init["host_memory_gb"] = float(os.environ[HOST_MEMORY_VARIABLE])
    return {"class_path": "offload.SlideFSDPStrategy", "init_args": init}


def _tiny(layers: int) -> dict[str, Any]:
    """The CPU mode's model and data: llama-tiny, at most 4 blocks, 2 x 64 tokens."""
    return {"model": {"preset": "llama-tiny", "config_overrides": {"num_hidden_layers": min(layers, 4)}},
            "data": {"init_args": {"vocab_size": 512, "seq_len": 64, "batch_size": 2}}}


def _shape(device: str, preset: str, layers: int, seq_len: int, batch: int) -> dict[str, Any]:
    if device == "cuda":
        return {"model": {"preset": preset, "config_overrides": {"num_hidden_layers": layers}},
                "data": {"init_args": {"vocab_size": 128256, "seq_len": seq_len, "batch_size": batch}}}
    return _tiny(layers)


def _accelerator(device: str) -> dict[str, Any]:
    return {"accelerator": "gpu" if device == "cuda" else "cpu", "devices": 1}


def _merge(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``more`` laid over it, key by key at every depth."""
    merged = dict(base)
    for key, value in more.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if both else value
    return merged


def _nest(settings: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` as ``{"a": {"b": 1}}``: a config override from dotted keys."""
    nested: dict[str, Any] = {}
    for dotted, value in settings.items():
        *parents, leaf = dotted.split(".")
        node = nested
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return nested


def _as_shipped(device: str, layers: int | None = None) -> dict[str, Any]:
    """What a run of configs/llama_8b_offload.yaml as shipped overrides: the device and, on a GPU, the host memory
    the preflight may count on (and ``layers`` of its 32 blocks, when given); on the CPU, llama-tiny in float32."""
    if device == "cuda":
        init = {"host_memory_gb": float(os.environ[HOST_MEMORY_VARIABLE])}
        overrides = {"model": {"config_overrides": {"num_hidden_layers": layers}}} if layers else {}
    else:
        init, overrides = {"param_dtype": "float32"}, _tiny(2)
    return {**overrides, "trainer": {**_accelerator(device),
                                     "strategy": {"class_path": "offload.SlideFSDPStrategy", "init_args": init}}}


#: The 8B's settings before issue 35, which windows 1-3 measured (docs/gpu_runs/2026-11-26-h100/summary-2.json, step
#: ``eight_b_fp32``): the control step lays them over configs/llama_8b_offload.yaml, whatever it ships.
EIGHT_B_BEFORE = {
    "data.init_args.batch_size": 8,  # 8 x 2048 = 16,384 tokens per optimizer step
    "trainer.gradient_clip_val": None,
    "trainer.strategy.init_args.optimizer_state_dtype": "float32",
    "trainer.strategy.init_args.delayed_update": False,
    "trainer.strategy.init_args.gradient_slots": 2,  # max(2, window): the ring of those windows
    "trainer.strategy.init_args.activation_offload": "cpu",
}


def step_slide_fsdp(record: Record, device: str, work: Path) -> None:
    """configs/llama_8b_offload.yaml as shipped with 8 of its 32 blocks (about 2.8B), 8 steps measured, host syncs
    counted."""
    syncs = {"class_path": "callbacks.HostSyncs", "init_args": {"warmup_steps": _warmup_steps(), "steps": 5}}
    config = _yaml(work / "slide_fsdp_shape.yaml", _as_shipped(device, layers=8))
    run = _fit("slide_fsdp", work, ["configs/quickstart.yaml", "configs/llama_8b_offload.yaml", str(config)], record,
               8 if device == "cuda" else 1, measure=_measuring(offload=True, extra=[syncs]))
    record.put(summary=run["figures"])


def step_parity(record: Record, device: str, work: Path) -> None:
    """float32: FSDP2 against SlideFSDP (window 2, checkpointed and offloaded activations, overlapped update),
    4 Llama-1B-shaped blocks, 15 steps: relative loss difference < 1e-5 at step 1 and < 1e-3 throughout."""
    steps = 15 if device == "cuda" else 4
    shape = _shape(device, "llama-1b", 4, 2048, 2)
    runs = {}
    for name, strategy in (
        ("parity_fsdp2", {"class_path": "lit_fsdp.strategy.FSDP2Strategy",
                          "init_args": {"sharding": "FULL_SHARD", "param_dtype": "float32", "reduce_dtype": "float32",
                                        "activation_checkpointing": 1}}),
        ("parity_slide_fsdp", _offload_strategy(device, "float32")),
    ):
        overrides = {**shape, "trainer": {**_accelerator(device), "gradient_clip_val": None, "strategy": strategy,
                                          "callbacks": [{"class_path": "callbacks.Results"}]}}
        config = _yaml(work / f"{name}_shape.yaml", overrides)
        runs[name] = _fit(name, work, ["configs/quickstart.yaml", str(config)], record, steps)["losses"]
    a, b = runs["parity_fsdp2"], runs["parity_slide_fsdp"]
    if len(a) != steps or len(b) != steps:
        raise RuntimeError(f"parity: {len(a)} and {len(b)} losses logged, {steps} expected")
    relative = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    record.put(relative_first=relative[0], relative_max=max(relative), passed=relative[0] < 1e-5 and max(relative) < 1e-3)
    if not record["passed"]:
        raise RuntimeError(f"parity: relative loss difference {relative[0]:.2e} at step 1, {max(relative):.2e} at most")


def _fsdp2_1b(name: str, record: Record, device: str, work: Path, batch: int | None = None,
              model: dict[str, Any] | None = None, **knobs: Any) -> None:
    """configs/llama_1b.yaml on one device with its preset's 128k vocabulary, ``batch`` sequences of 2048 tokens
    (default: the config's), ``model`` settings and the strategy's ``knobs`` laid over it, 28 steps measured after
    the warm-up; on the CPU, llama-tiny in float32."""
    if device == "cuda":
        overrides = {"data": {"init_args": {"vocab_size": 128256, **({"batch_size": batch} if batch else {})}}}
    else:
        overrides, knobs = _tiny(16), {**knobs, "param_dtype": "float32", "compile_blocks": False}
    overrides = _merge(overrides, {"model": model or {}, "trainer": _accelerator(device)})
    if knobs:
        overrides["trainer"]["strategy"] = {"class_path": "lit_fsdp.strategy.FSDP2Strategy", "init_args": knobs}
    config = _yaml(work / f"{name}_shape.yaml", overrides)
    run = _fit(name, work, ["configs/quickstart.yaml", "configs/llama_1b.yaml", str(config)], record,
               28 if device == "cuda" else 1, measure=_measuring(offload=False))
    record.put(summary=run["figures"])


def step_fsdp2_1b(record: Record, device: str, work: Path) -> None:
    """configs/llama_1b.yaml as shipped (FSDP2, Llama-3.2-1B shape, 128k vocabulary): MFU and device peak."""
    _fsdp2_1b("fsdp2_1b", record, device, work)


def step_fsdp2_1b_no_ac(record: Record, device: str, work: Path) -> None:
    """configs/llama_1b_low_memory.yaml's setting (4 x 2048, chunked loss, eager) without activation checkpointing:
    the recompute's cost in MFU."""
    _fsdp2_1b("fsdp2_1b_no_ac", record, device, work, batch=4, model={"loss_chunk_tokens": 1024},
              activation_checkpointing=0, compile_blocks=False)


def step_fsdp2_1b_compiled(record: Record, device: str, work: Path) -> None:
    """fsdp2_1b at 4 x 2048, compiled blocks, the plain loss, no activation checkpointing: the setting of the H200's
    unrecorded 39.3% row (docs/gpu.md), measured again."""
    _fsdp2_1b("fsdp2_1b_compiled", record, device, work, batch=4, model={"loss_chunk_tokens": 0},
              activation_checkpointing=0, compile_blocks=True)


def step_fsdp2_1b_fast(record: Record, device: str, work: Path) -> None:
    """fsdp2_1b as fast as the first window found it: 8 x 2048 tokens, compiled blocks, the plain loss, no
    activation checkpointing (42.8% MFU on the H100, 57 GiB peak; the H200's unrecorded 46.0% row)."""
    _fsdp2_1b("fsdp2_1b_fast", record, device, work, batch=8, model={"loss_chunk_tokens": 0},
              activation_checkpointing=0, compile_blocks=True)


def _eight_b(name: str, record: Record, device: str, work: Path, overrides: dict[str, Any]) -> None:
    """configs/llama_8b_offload.yaml's 8B (llama-tiny on the CPU) with ``overrides``, 3 steps measured after the
    warm-up; the watchdog ends it before the host runs out of memory, and a run cut by its deadline still reports
    set-up time, steps done and steps/s."""
    config = _yaml(work / f"{name}_shape.yaml", overrides)
    run = _fit(name, work, ["configs/quickstart.yaml", "configs/llama_8b_offload.yaml", str(config)], record, 3,
               measure=_measuring(offload=True))
    record.put(summary=run["figures"])


def step_eight_b(record: Record, device: str, work: Path) -> None:
    """configs/llama_8b_offload.yaml as shipped (whatever it sets when the check runs): tokens/s, MFU, the CPU
    update's ms and GB/s, the device's idle time inside the backward, the hidden and hideable shares, device peak
    and the lowest MemAvailable."""
    _eight_b("eight_b", record, device, work, _as_shipped(device))


def step_eight_b_control(record: Record, device: str, work: Path) -> None:
    """The control: the 8B with the settings measured before issue 35 (``EIGHT_B_BEFORE``: 8 x 2048 tokens, float32
    moments, no delayed update, 2 gradient slots, no clipping, activations offloaded), the same figures."""
    _eight_b("eight_b_control", record, device, work, _merge(_as_shipped(device), _nest(EIGHT_B_BEFORE)))


def step_eight_b_eager(record: Record, device: str, work: Path) -> None:
    """The 8B as shipped with its blocks left eager (``compile_blocks: false``): what compiling is worth to SlideFSDP's
    step."""
    eager = {"trainer": {"strategy": {"init_args": {"compile_blocks": False}}}}
    _eight_b("eight_b_eager", record, device, work, _merge(_as_shipped(device), eager))


def step_onebit(record: Record, device: str, work: Path) -> None:
    """FSDP2 + 1-bit Adam on one device across its freeze, under sync-debug mode (host syncs per step by call site)
    and the communication profiler on a real trace."""
    overrides = {
        "model": {"preset": "llama-1b" if device == "cuda" else "llama-tiny",
                  "config_overrides": {"num_hidden_layers": 4 if device == "cuda" else 2}},
        "data": {"init_args": {"vocab_size": 32000 if device == "cuda" else 512, "seq_len": 2048 if device == "cuda" else 64,
                               "batch_size": 2}},
        "trainer": {**_accelerator(device), "gradient_clip_val": None,
                    "strategy": {"class_path": "lit_fsdp.strategy.FSDP2Strategy",
                                 "init_args": {"compression": {"method": "onebit_adam", "freeze_step": 4, "chunk_size": 128,
                                                               "bound": 1.0}}}},
    }
    extra = [{"class_path": "callbacks.HostSyncs", "init_args": {"warmup_steps": 2, "steps": 8}},
             {"class_path": "callbacks.CommProfiler", "init_args": {"wait": 5, "warmup": 1, "active": 3}}]
    config = _yaml(work / "onebit_shape.yaml", overrides)
    run = _fit("onebit", work, ["configs/quickstart.yaml", str(config)], record, 10,
               measure=_measuring(offload=False, extra=extra))
    result = run["result"]
    record.put(summary={**run["figures"], **{k: v for k, v in result.items() if k.startswith(("host_syncs", "comm_"))}})


def step_codecs(record: Record, device: str, work: Path) -> None:
    """scripts/bench_codecs.py on the device, 64M values: GB/s per codec (compare with the probe's device copy)."""
    # on the CPU, three codecs: the step's code path (bench_codecs times each until its spread settles, up to 10 s)
    sizes = ["--numel", str(64 * 2**20)] if device == "cuda" else ["--numel", str(2**20), "--methods", "fp16", "int8", "topk"]
    lines = _command("codecs", [sys.executable, "scripts/bench_codecs.py", "--device", device, *sizes, "--repeats", "5",
                                "--warmup", str(_warmup_steps())], work, record)
    record.put(table=[line for line in lines if line.startswith("|")])


# --- the other steps: for the windows that follow (--steps names them) ---------------------------------------


def step_bench_offload(record: Record, device: str, work: Path) -> None:
    """scripts/bench_offload.py: SlideFSDP against torch's CPUOffloadPolicy and plain FSDP2 on one device."""
    warmup = _warmup_steps()
    gpu = ["--accelerator", "gpu", "--devices", "1", "--param-dtype", "bfloat16", "--presets", "llama-1b",
           "--seq-len", "2048", "--batch-size", "8", "--steps", str(warmup + 8)]
    cpu = ["--devices", "1", "--presets", "gpt2-tiny", "--seq-len", "64", "--batch-size", "2", "--steps", str(warmup + 1),
           "--strategies", "slide_fsdp"]
    _command("bench_offload", [sys.executable, "scripts/bench_offload.py", *(gpu if device == "cuda" else cpu),
                               "--warmup", str(warmup), "--repeats", "1", "--out", str(work / "bench_offload")], work, record)
    record.put(table=(work / "bench_offload" / "table.md").read_text().splitlines())


def step_resume_export(record: Record, device: str, work: Path) -> None:
    """Exact resume on the device (stopped at step 4 of 8 and resumed equals the uninterrupted run), then export."""
    base = ["configs/quickstart.yaml"]
    shape = _yaml(work / "resume_shape.yaml", {"trainer": {**_accelerator(device), "callbacks": [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"save_last": True, "every_n_train_steps": 4, "save_top_k": -1}}]}})
    whole = _fit("resume_whole", work, [*base, str(shape)], record, 8, checkpoints=True)["losses"]
    first = _fit("resume_first", work, [*base, str(shape)], record, 4, checkpoints=True)
    checkpoint = work / "resume_first" / "checkpoints" / "last.ckpt"
    rest = _fit("resume_rest", work, [*base, str(shape)], record, 8, checkpoints=True, ckpt_path=str(checkpoint),
                folder=work / "resume_first")
    resumed = first["losses"] + rest["losses"][len(first["losses"]):]
    record.put(whole=whole, resumed=resumed, exact=whole == resumed)
    _command("export", [sys.executable, "-m", "lit_fsdp", "export", str(checkpoint), str(work / "exported")], work, record)
    if whole != resumed:
        raise RuntimeError(f"resume: {resumed} differs from the uninterrupted {whole}")


def step_tune(record: Record, device: str, work: Path) -> None:
    """``tune`` with 4 trials on the device (its memory filter and trial runner on a real GPU)."""
    configs = ["--config", "configs/quickstart.yaml"] + (["--config", "configs/llama_1b.yaml", "--trainer.devices", "1"]
                                                         if device == "cuda" else ["--trainer.devices", "1"])
    trials = "4" if device == "cuda" else "1"
    lines = _command("tune", [sys.executable, "-m", "lit_fsdp", "tune", *configs, "--tune.trials", trials,
                              "--tune.out", str(work / "tune")], work, record)
    record.put(report=lines[-30:])


def _sft_base(device: str, folder: Path) -> Path:
    """A pretrained folder as ``export`` writes one: Llama-1B's blocks (llama-tiny on the CPU) and a BPE trained on the
    sample task's text, whose vocabulary the model takes."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_fsdp.data.chat import read_samples
    from lit_fsdp.data.tokenizer import train_bpe
    from lit_fsdp.presets import build_config

    texts = [" ".join(content for _, content in sample.turns) for sample, _ in read_samples(SFT_SAMPLES / "train.jsonl")]
    tokenizer = train_bpe(texts[:1000], 400)
    tokenizer.save_pretrained(folder)
    config = build_config("llama-1b" if device == "cuda" else "llama-tiny", {"vocab_size": len(tokenizer)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(folder, safe_serialization=True)
    return folder


SFT_SAMPLES = ROOT / "lit_fsdp" / "data" / "samples" / "reverse_words"


def step_sft(record: Record, device: str, work: Path) -> None:
    """Fine-tuning (issue 29) on one device: configs/sft_full.yaml against configs/sft_lora.yaml, packed, from a
    Llama-1B-shaped pretrained folder: tokens/s, device peak, the loss falling."""
    base = _sft_base(device, work / "sft_base")
    shape = {"seq_len": 2048, "batch_size": 4} if device == "cuda" else {"seq_len": 64, "batch_size": 2}
    steps = 18 if device == "cuda" else 1
    for config in ("sft_full", "sft_lora"):
        override = _yaml(work / f"{config}_shape.yaml", {
            "trainer": _accelerator(device),
            "model": {"pretrained_path": str(base)},
            "data": {"init_args": {**shape, "train_path": str(SFT_SAMPLES / "train.jsonl"),
                                   "val_path": str(SFT_SAMPLES / "val.jsonl")}}})
        run = _fit(config, work, [f"configs/{config}.yaml", str(override)], record, steps,
                   measure=_measuring(offload=False))
        losses = run["losses"]
        record.put(**{f"{config}_summary": {**run["figures"], "first_loss": losses[0], "last_loss": losses[-1]}})
        if not losses[-1] < losses[0]:
            raise RuntimeError(f"{config}: the loss did not fall ({losses[0]:.4f} to {losses[-1]:.4f})")


def step_eight_b_lora(record: Record, device: str, work: Path) -> None:
    """LoRA rank 16 on the 8B under SlideFSDP (issue 29) with the control's settings (``EIGHT_B_BEFORE``): the frozen
    base once on the host in bfloat16, the adapters' master and moments on the host AdamW; compare the host and
    device peaks with ``estimate``'s (written beside the record)."""
    lora = {"model": {"lora": {"rank": 16, "alpha": 32}}}
    _eight_b("eight_b_lora", record, device, work, _merge(_merge(_as_shipped(device), _nest(EIGHT_B_BEFORE)), lora))


#: Every step and its deadline in seconds on one H100: about 1.25x its longest time in docs/gpu_runs/ (the estimate's
#: few seconds added), or, for a step no record has timed yet, its set-up and steps counted from the nearest record.
STEPS: dict[str, tuple[Callable[[Record, str, Path], None], int]] = {
    "probe": (step_probe, 60),  # 48 s on the H100
    # the 8B as shipped: 110-130 s to the first step (about 100 GB of host buffers touched, its blocks compiled), 5 steps
    # of 64k tokens at about 8 s, the last delayed update and the estimate: 193 s on the H100 (as eight_b_compiled)
    "eight_b": (step_eight_b, 235),
    # 41 s on the H200; 54 s for the compiled 8 x 2048 setting on the H100, 89 s on the next H100 (a 50 s compile)
    "fsdp2_1b": (step_fsdp2_1b, 110),
    "cuda_tests": (step_cuda_tests, 70),  # 41 s on the H100
    # --- beyond the default plan: --steps names them
    "eight_b_control": (step_eight_b_control, 170),  # 139 s on the H100
    "eight_b_eager": (step_eight_b_eager, 205),  # 170 s on the H100 (as eight_b)
    "slide_fsdp": (step_slide_fsdp, 180),
    "parity": (step_parity, 130),
    "onebit": (step_onebit, 70),
    "codecs": (step_codecs, 45),
    "fsdp2_1b_no_ac": (step_fsdp2_1b_no_ac, 75),
    "fsdp2_1b_compiled": (step_fsdp2_1b_compiled, 90),
    "fsdp2_1b_fast": (step_fsdp2_1b_fast, 120),
    "bench_offload": (step_bench_offload, 240),
    "resume_export": (step_resume_export, 120),
    "tune": (step_tune, 300),
    "sft": (step_sft, 170),
    "eight_b_lora": (step_eight_b_lora, 200),
}
#: The default plan: the probe (its hardware.json is what every estimate uses), the 8B and the 1B as shipped, the
#: CUDA-only tests. It fits one device call: their deadlines add up to PLAN_SECONDS at most. The 8B's control and
#: its eager blocks (measured in docs/gpu_runs/2026-11-27-h100) no longer fit beside them: --steps names them.
PLAN = ("probe", "eight_b", "fsdp2_1b", "cuda_tests")
PLAN_SECONDS = 540  # a device call's 10 minutes, less a minute for the wheels' install, Python's start and the copy back
PLAN_BUDGET = sum(STEPS[name][1] for name in PLAN)  # --budget's default
#: The CPU mode's deadlines are the GPU's times this: tiny sizes, but each run's set-up and estimate on the 2 shared
#: cores of a CI machine.
CPU_DEADLINE_FACTOR = 3
# the 8B steps run only if slide_fsdp passed, when it ran too
REQUIRES = {name: "slide_fsdp" for name in ("eight_b", "eight_b_control", "eight_b_lora", "eight_b_eager")}


# --- driver --------------------------------------------------------------------------------------------


def _bring_back(records: list[dict[str, Any]], work: Path, out: Path) -> None:
    """The call's files under ``out``, few so that a device window brings them back: ``summary.json`` (the records),
    ``hardware.json`` (the probe's) and ``estimate.json`` (every run's estimate, by run name, as written beside it)."""
    (out / "summary.json").write_text(json.dumps(records, indent=1, default=str))
    if (work / "hardware.json").is_file():
        (out / "hardware.json").write_text((work / "hardware.json").read_text())
    estimates = {name: json.loads((work / run["estimate"]["file"]).read_text())
                 for name, run in _runs(records) if "file" in run.get("estimate", {})}
    if estimates:
        (out / "estimate.json").write_text(json.dumps(estimates, indent=1) + "\n")


def _run_step(name: str, deadline: float, device: str, work: Path, log: Any) -> dict[str, Any]:
    """The step in a child process group, killed at ``deadline`` seconds; its record with status and time."""
    record_path = work / f"{name}.json"
    record_path.unlink(missing_ok=True)
    log.write(f"\n===== {name} (deadline {deadline:.0f} s) =====\n")
    log.flush()
    begin = time.perf_counter()
    child = subprocess.Popen([sys.executable, __file__, "--child", name, "--device", device, "--work", str(work)],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        rc = child.wait(timeout=deadline)
        status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        rc, status = None, "timeout"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    return {"step": name, "status": status, "rc": rc, "seconds": round(time.perf_counter() - begin, 1), **record}


def _child(name: str, device: str, work: Path) -> int:
    sys.path.insert(0, str(ROOT))
    record = Record(work / f"{name}.json")
    try:
        STEPS[name][0](record, device, work)
    except Exception as error:  # the record keeps the reason; the driver goes on with the next step
        record.put(error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        raise
    return 0


def _runs(records: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every training run of the records, by name: the values that are a ``_fit`` record."""
    return [(name, run) for record in records for name, run in record.items()
            if isinstance(run, dict) and "losses" in run and "rc" in run]


#: The runs table's columns: heading, the key in a run's figures, format.
RUN_COLUMNS = (("left out", "warmup_steps_left_out", "d"), ("measured", "steps_measured", "d"),
               ("tokens/s", "tokens_per_s", ",.0f"), ("MFU", "mfu", ".1%"),
               ("update ms", "offload_cpu_update_ms", ",.0f"),
               ("update GB/s", "offload_cpu_update_gbps", ".1f"), ("idle ms", "offload_device_idle_ms", ",.0f"),
               ("hidden", "offload_cpu_update_hidden_share", ".2f"),
               ("hideable", "offload_cpu_update_hideable_share", ".2f"), ("peak GiB", "peak_allocated_gb", ".2f"),
               ("min avail GiB", "min_mem_available_gib", ".1f"), ("est. step s", "estimate_step_time_s", ".2f"))


def _runs_table(records: list[dict[str, Any]]) -> str:
    """The measured runs' rates, the first steps left out (the column says how many), ``n/a`` for a figure the run's
    record does not hold; update GB/s is ``estimate``'s bytes over the measured update time."""
    lines = [f"{'run':<20}" + "".join(f"{heading:>{max(len(heading), 8) + 2}}" for heading, _, _ in RUN_COLUMNS)]
    for name, run in _runs(records):
        if "figures" not in run:
            continue
        cells = []
        for heading, key, form in RUN_COLUMNS:
            value = run["figures"].get(key)
            cells.append(f"{'n/a' if value is None else format(value, form):>{max(len(heading), 8) + 2}}")
        lines.append(f"{name:<20}" + "".join(cells))
    return "\n".join(lines)


def _table(records: list[dict[str, Any]]) -> str:
    lines = [f"{'step':<20}{'status':<9}{'s':>7}  figures"]
    for r in records:
        shown = {k: v for k, v in r.items() if k not in ("step", "status", "rc", "seconds", "versions", "hardware", "cpu",
                                                         "nvidia_smi", "failed") and not isinstance(v, (dict, list))}
        if isinstance(r.get("summary"), dict):
            shown.update({k: v for k, v in r["summary"].items()
                          if k in ("warmup_steps_left_out", "tokens_per_s", "mfu") or "hidden" in k})
        text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
        lines.append(f"{r['step']:<20}{r['status']:<9}{r['seconds']:>7.1f}  {text[:400]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="folder for summary.json, check.log, hardware.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: the real check; cpu: tiny sizes (CI)")
    parser.add_argument("--steps", default=",".join(PLAN),
                        help=f"comma-separated, in order (default: {', '.join(PLAN)}); of {', '.join(STEPS)}")
    parser.add_argument("--budget", type=float, default=float(PLAN_BUDGET),
                        help="seconds for all steps together (default: the default plan's deadlines added up)")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS,
                        help="optimizer steps at the start of every training run left out of every rate")
    parser.add_argument("--host-memory-gb", type=float, default=120.0,
                        help="host memory SlideFSDP's preflight may count on (its host_memory_gb); the lent VM has 128 GiB")
    parser.add_argument("--work", type=Path, help="folder for the runs' own files (default: <out>/work)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, args.device, args.work)
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps {args.warmup_steps}: must be 0 or more (optimizer steps left out of every rate)")
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown step {unknown[0]!r}; steps are {', '.join(STEPS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda but torch sees no CUDA device; use --device cpu for the CPU mode")
    os.environ[HOST_MEMORY_VARIABLE] = str(args.host_memory_gb)
    os.environ[WARMUP_VARIABLE] = str(args.warmup_steps)
    print("versions:", ", ".join(f"{k} {v or 'missing'}" for k, v in _versions().items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + args.budget
    records = []
    with open(args.out / "check.log", "a") as log:
        for name in steps:
            left = end - time.monotonic()
            if left < 5:
                records.append({"step": name, "status": "no_time", "rc": None, "seconds": 0.0})
                continue
            needed = next((r for r in records if r["step"] == REQUIRES.get(name)), None)
            if needed is not None and needed["status"] != "ok":
                records.append({"step": name, "status": "skipped", "rc": None, "seconds": 0.0,
                                "error": f"{needed['step']} did not pass ({needed['status']})"})
                continue
            deadline = STEPS[name][1] * (CPU_DEADLINE_FACTOR if args.device == "cpu" else 1)
            records.append(_run_step(name, min(deadline, left), args.device, work, log))
            _bring_back(records, work, args.out)
            print(f"{name}: {records[-1]['status']} in {records[-1]['seconds']} s", flush=True)
    _bring_back(records, work, args.out)
    if any("figures" in run for _, run in _runs(records)):
        print(f"Training runs; every rate leaves out the first {args.warmup_steps} optimizer steps of its run:")
        print(_runs_table(records))
    print(_table(records))
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
