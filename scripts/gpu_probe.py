"""The GPU check's probe: what the machine is (versions, the device, host memory, cores as SlideFSDP's binding sees
them) and what it does (copies, GEMMs, SlideFSDP's CPU update, a transformer's step), written as ``hardware.json`` in
``--tune.hardware``'s format, so that every ``estimate`` after it uses this machine's measured rates."""

from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from gpu_fit import GIB, Record, command, meminfo

PACKAGES = ("torch", "lightning", "transformers", "huggingface_hub", "tokenizers", "safetensors", "torchmetrics",
            "jsonargparse", "docstring_parser", "typeshed_client", "ijson", "wandb", "numpy", "triton", "pytest")


def versions() -> dict[str, str | None]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def median_ms(run: Callable[[], None], repeats: int, device: str) -> float:
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


def cpu_view(device: str) -> dict[str, Any]:
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
        threads = min(update_threads(1), binding.threads)  # what SlideFSDP's UpdateThreads.plan takes, one rank
        view.update(gpu_pci=pci, gpu_numa_node=numa_node_of(pci), update_threads=threads,
                    update_threads_reason=f"{threads} update threads: {describe_cores()}; one core left to launching "
                                          f"kernels; bound to {binding.describe()}")
    return view


def registration(record: Record) -> None:
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


def bandwidths(record: Record, device: str) -> dict[str, float]:
    """Copies (host to device and back, registered and pageable; on the device; on the host) in GB/s and TB/s, and
    GEMMs in TFLOP/s: bfloat16 and float32 on a GPU (and float8, ``torch._scaled_mm`` with one scale per tensor as
    ``--model.float8 tensorwise`` calls it, where the GPU has float8 tensor cores), float32 on the CPU."""
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
            rates[f"h2d_{name}_gbps"] = size / median_ms(lambda: gpu.copy_(host, non_blocking=True), 5, device) / 1e6
            rates[f"d2h_{name}_gbps"] = size / median_ms(lambda: host.copy_(gpu, non_blocking=True), 5, device) / 1e6
        if pinned:
            torch.cuda.cudart().cudaHostUnregister(registered.data_ptr())
        other = torch.empty_like(gpu)
        rates["device_copy_tbps"] = 2 * size / median_ms(lambda: other.copy_(gpu), 10, device) / 1e9
        del gpu, other, pageable, registered
        n = 8192
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        rates["gemm_bf16_tflops"] = 2 * n**3 / median_ms(lambda: a @ b, 10, device) / 1e9
        a32, b32 = a.float(), b.float()
        rates["gemm_fp32_tflops"] = 2 * n**3 / median_ms(lambda: a32 @ b32, 5, device) / 1e9
        if torch.cuda.get_device_capability() >= (8, 9):  # the second operand column-major, as _scaled_mm takes it
            a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
            one = torch.ones((), device="cuda")
            try:  # a private op: its failure is recorded, and the probe's other rates stand
                rates["gemm_fp8_tflops"] = 2 * n**3 / median_ms(
                    lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10, device) / 1e9
            except RuntimeError as error:
                record.put(gemm_fp8_error=str(error).splitlines()[0])
            del a8, b8
        del a, b, a32, b32
        torch.cuda.empty_cache()
    host_size = (4 * GIB) if device == "cuda" else (256 << 20)
    source = torch.empty(host_size // 4, dtype=torch.float32).fill_(1.5)
    target = torch.empty_like(source)
    rates["host_copy_gbps"] = 2 * host_size / median_ms(lambda: target.copy_(source), 5, "cpu") / 1e6
    if device == "cpu":
        n = 1024
        a, b = torch.randn(n, n), torch.randn(n, n)
        rates["gemm_fp32_tflops"] = 2 * n**3 / median_ms(lambda: a @ b, 5, device) / 1e9
    rates = {key: round(value, 3) for key, value in rates.items()}
    record.put(**rates)
    return rates


def update_rate(record: Record, device: str, work: Path) -> dict[str, float]:
    """GB/s of SlideFSDP's CPU update on this host (the native kernel, its threads the cores less one, as the 8B run's):
    ``scripts/bench_cpu_update.py``'s rows with float32 and bfloat16 moments, bfloat16 gradients."""
    threads = max(1, (os.cpu_count() or 2) - 1)
    out = work / "bench_cpu_update.jsonl"
    out.unlink(missing_ok=True)
    command("cpu_update", [sys.executable, "scripts/bench_cpu_update.py", "--numel", str(2**27 if device == "cuda" else 2**22),
                           "--threads", str(threads), "--repeats", "2", "--paths", "native", "--out", str(out)],
            work, record)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    rates = {f"cpu_update_{row['optimizer_state_dtype']}_moments_gbps": round(row["gbps"], 1)
             for row in rows if row["gradient_dtype"] == "bfloat16"}
    rates["cpu_update_copy_gbps"] = round(rows[0]["copy_gb_per_s"], 1)
    record.put(cpu_update_threads=threads, **rates)
    return rates


def model_efficiency(record: Record, peak_tflops: float) -> float:
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

    seconds = median_ms(step, 3, "cuda") / 1e3
    flops = tokens.numel() * (flops_per_token(config, 2048) + recompute_flops_per_token(config, 2048, 1))
    efficiency = flops / seconds / (peak_tflops * 1e12)
    record.put(model_step_s=round(seconds, 4), model_tflops=round(flops / seconds / 1e12, 1),
               compute_efficiency=round(efficiency, 3))
    del model
    torch.cuda.empty_cache()
    return efficiency


def probe(record: Record, device: str, work: Path) -> None:
    """Versions, the device, host memory, cores; a large registration and its failure path; measured rates, and
    ``<work>/hardware.json`` from them."""
    import torch

    record.put(python=sys.version.split()[0], kernel=os.uname().release, versions=versions(), torch_cuda=torch.version.cuda,
               torch_cuda_available=torch.cuda.is_available(), **meminfo())
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,"
             "temperature.gpu", "--format=csv,noheader"], capture_output=True, text=True)
        record.put(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 2), sms=props.multi_processor_count,
                   l2_mb=round(getattr(props, "L2_cache_size", 0) / 1e6, 1), nvidia_smi=smi.stdout.strip() or smi.stderr.strip(),
                   cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    record.put(cpu=cpu_view(device))
    if device == "cuda":
        registration(record)
    rates = bandwidths(record, device)
    from lit_fsdp.commands.tune.hardware import detect

    hardware = asdict(detect())
    update = update_rate(record, device, work)
    # estimate's rates: the update's own (bfloat16 moments, as the 8B config ships), the copies', and on a GPU the
    # share of the measured GEMM peak a transformer's forward and backward reach
    hardware["host_memory_gbps"] = update.get("cpu_update_bfloat16_moments_gbps") or round(rates["host_copy_gbps"], 1)
    if device == "cuda":
        hardware["pcie_gbps"] = round(min(rates["h2d_registered_gbps"], rates["d2h_registered_gbps"]), 1)
        hardware["peak_tflops"] = {**hardware["peak_tflops"], "bf16": round(rates["gemm_bf16_tflops"], 1)}
        if "gemm_fp8_tflops" in rates:  # estimate's rate for the blocks' linear layers under --model.float8
            hardware["peak_tflops"]["fp8"] = round(rates["gemm_fp8_tflops"], 1)
        hardware["compute_efficiency"] = round(min(1.0, model_efficiency(record, rates["gemm_bf16_tflops"])), 3)
    (work / "hardware.json").write_text(json.dumps(hardware, indent=2) + "\n")
    record.put(hardware=hardware)
