"""scripts/bench_peers.py: a peer whose host state cannot fit is refused with what it would ask for, a peer that fails
or runs out of time is a row that says how, a record holds its rates over the steps after the warm-up and every
step's time, and the table shows them; and, where deepspeed is installed, the CPU mode end to end: every peer on 2
processes, each either run or failed for the one reason it cannot run on a CPU."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import bench_peers  # noqa: E402
import peers_table  # noqa: E402
from peers_table import GIB, HOST_RESERVE_GIB, PEERS, Shape, auto_layers, refusal, table  # noqa: E402

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
OFFLOADING = [name for name, peer in PEERS.items() if peer.host_bytes_per_param]
#: Why a peer cannot run on a CPU, in the words of its own error: its row is accepted as failed only with these.
CANNOT_RUN_ON_CPU = {"lightning_fsdp_cpu_offload": "The strategy `fsdp` requires a GPU accelerator"}


@pytest.mark.parametrize(("preset", "layers"), [("llama-tiny", None), ("llama-1b", 2), ("llama-8b", 1)])
def test_the_parameter_count_is_the_models(preset, layers):
    from transformers import AutoModelForCausalLM

    shape = Shape.of(preset, layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.config)
    assert shape.parameters == sum(p.numel() for p in model.parameters())  # tied heads counted once


def test_the_8b_is_refused_on_a_128_gib_host_with_what_each_offloading_peer_would_ask_for():
    eight_b = Shape.of("llama-8b", None)
    assert eight_b.layers == 32 and 8.0e9 < eight_b.parameters < 8.1e9
    for name in OFFLOADING:
        peer = PEERS[name]
        need = peer.host_bytes_per_param * eight_b.parameters / GIB
        why = refusal(peer, eight_b.parameters, host_gib=120.0, device_gib=141.0)
        assert why is not None and why.startswith(f"needs {need:.1f} GiB of host memory ({peer.host_bytes_per_param} "
                                                  f"B/param x 8.03e9 parameters: float32 master weights")
        assert f"and {HOST_RESERVE_GIB} GiB for the process, against 120.0 GiB available" in why and "\n" not in why
    assert PEERS["deepspeed_zero3_offload"].host_bytes_per_param == 18  # its bfloat16 parameters on the host too
    # 16 B/param x 8.03e9 is 119.7 GiB: within a 128 GiB host's ~125 GiB available alone, not with the process beside it
    assert refusal(PEERS["fsdp2_cpu_offload"], eight_b.parameters, host_gib=125.0, device_gib=None) is not None
    assert refusal(PEERS["fsdp2_cpu_offload"], eight_b.parameters, host_gib=16 * eight_b.parameters / GIB + 8.01,
                   device_gib=None) is None
    # SlideFSDP has no fixed host state the bench checks: its own preflight decides, in its run
    assert refusal(PEERS["slide_fsdp"], eight_b.parameters, host_gib=1.0, device_gib=1.0) is None


def test_zero2_is_refused_where_its_bfloat16_weights_do_not_fit_the_device():
    parameters = 8 * 10**9
    why = refusal(PEERS["deepspeed_zero2_offload"], parameters, host_gib=1000.0, device_gib=14.0)
    assert why == "needs 14.9 GiB on the device (2 B/param x 8.00e9 bfloat16 weights) against its 14.0 GiB; run fewer --layers"
    assert refusal(PEERS["deepspeed_zero2_offload"], parameters, host_gib=1000.0, device_gib=None) is None  # CPU
    assert refusal(PEERS["deepspeed_zero3_offload"], parameters, host_gib=1000.0, device_gib=14.0) is None


def test_auto_is_the_most_blocks_every_peer_fits_with_deepspeeds_buffer_factor():
    peers = list(PEERS.values())
    layers = auto_layers("llama-8b", peers, host_gib=120.0, device_gib=141.0)
    fits = lambda count: all(refusal(p, int(Shape.of("llama-8b", count).parameters * peers_table.AUTO_FACTOR), 120.0,
                                     141.0) is None for p in peers)
    assert layers is not None and 8 <= layers < 32 and fits(layers) and not fits(layers + 1)
    assert auto_layers("llama-8b", peers, host_gib=8.5, device_gib=None) is None  # not one block beside the reserve
    assert auto_layers("llama-8b", [PEERS["slide_fsdp"]], host_gib=1.0, device_gib=None) == 32


def args_for(tmp_path, *argv: str) -> argparse.Namespace:
    return bench_peers.parse(["--device", "cpu", "--out", str(tmp_path / "peers.jsonl"), *argv])


def test_a_run_becomes_a_record_with_its_rates_after_the_warmup_and_every_steps_time(tmp_path, monkeypatch):
    def ran(peer, spec, folder, args):
        assert spec["adamw"] == {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "clip": 1.0}
        return {"status": "ok", "step_times_ms": [900.0, 100.0, 300.0], "losses": [6.2, 6.1, 6.0],
                "host_peak_rss_gib": 0.5, "device_peak_gib": None, "device_peak_reserved_gib": None, "versions": {}}

    monkeypatch.setattr(bench_peers, "worker_run", ran)
    args = args_for(tmp_path)
    record = bench_peers.run_peer("fsdp2_cpu_offload", Shape.of("llama-tiny", 2), args, 20.0, (None, None))
    assert args.tokens_per_step == 2 * 64 * 2 == record["tokens_per_step"]
    assert record["status"] == "ok" and record["steps_measured"] == 2 and record["warmup_steps_left_out"] == 1
    assert record["tokens_per_s"] == pytest.approx(256 * 2 / 0.4) and record["mfu"] is None  # no peak on a CPU
    assert record["step_times_ms"] == [900.0, 100.0, 300.0] and record["compute_dtype"] == "bfloat16"
    assert record["host_needed_gib"] == pytest.approx(16 * record["parameters"] / GIB)
    assert record["shape"] == {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 176, "vocab": 512}
    json.dumps(record)  # a JSON line
    # on a GPU the table's bfloat16 peak gives MFU: flops per token x tokens/s per device over the peak
    args.device = "cuda"
    shape = Shape.of("llama-tiny", 2)
    on_gpu = bench_peers.run_peer("fsdp2_cpu_offload", shape, args, 20.0, ("NVIDIA H100 80GB HBM3", 80.0))
    expected = shape.flops_per_token(64) * on_gpu["tokens_per_s"] / 2 / 989.5e12
    assert on_gpu["peak_tflops"] == 989.5 and on_gpu["mfu"] == pytest.approx(expected)


@pytest.mark.parametrize(("rc", "output", "status", "error"), [
    (1, "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "2.00 GiB\nmore\n", "failed", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    (1, "ModuleNotFoundError: No module named 'deepspeed'\n", "failed", "ModuleNotFoundError: No module named 'deepspeed'"),
    (-9, "", "failed", "killed by SIGKILL (out of host memory, or stopped from outside)"),
    (1, "  traceback : Signal 9 (SIGKILL) received by PID 7\ntorch.distributed.elastic.multiprocessing.errors."
        "ChildFailedError: \n", "failed", "a rank was killed by SIGKILL (out of host memory, or stopped from outside)"),
    (2, "lit_fsdp: error: --data.seq_len 0 must be positive\n", "failed", "lit_fsdp: error: --data.seq_len 0 must be positive"),
    (None, "", "timeout", "timed out after 600 s"),
])
def test_a_peer_that_fails_or_runs_out_of_time_is_a_row_that_says_how(tmp_path, monkeypatch, rc, output, status, error):
    monkeypatch.setattr(bench_peers, "run_group", lambda argv, folder, timeout, env: (rc, output))
    args = args_for(tmp_path)
    record = bench_peers.run_peer("fsdp2_cpu_offload", Shape.of("llama-tiny", 2), args, 20.0, (None, None))
    assert (record["status"], record["error"]) == (status, error) and "tokens_per_s" not in record
    row = table([record]).splitlines()[-1]
    assert f"| {status}: {error} |" in row


def test_a_peer_past_its_deadline_is_killed_with_every_rank_torchrun_started(tmp_path):
    args = args_for(tmp_path, "--timeout", "4")
    record = bench_peers.run_peer("fsdp2_cpu_offload", Shape.of("llama-tiny", 2), args, 20.0, (None, None))
    assert (record["status"], record["error"]) == ("timeout", "timed out after 4 s")
    spec = str(args.work / "llama-tiny-2-fsdp2_cpu_offload" / "spec.json")
    alive = processes_running(spec)
    deadline = time.monotonic() + 30  # SIGKILL is delivered at once, but a process is gone only when the kernel is done
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = processes_running(spec)
    assert not alive, f"processes of the killed run still alive 30 s after the kill: {alive}"


def processes_running(argument: str) -> list[str]:
    """The processes whose command line holds ``argument``, zombies left out (their command line reads empty)."""
    alive = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            alive += [cmdline.parent.name] if argument in cmdline.read_text() else []
        except OSError:  # a process that ended while being read
            pass
    return alive


def test_slide_fsdp_runs_the_shipped_8b_config_with_the_peers_adamw_and_shape(tmp_path, monkeypatch):
    calls = []

    def launch(configs, fit_args, folder, timeout_s):
        calls.append(dict(zip(fit_args[::2], fit_args[1::2])))
        (folder / "results.jsonl").write_text(json.dumps({"peak_rss_gb": 0.4, "offload_cpu_update_ms": 3.0}) + "\n")
        (folder / "throughput.json").write_text(json.dumps({"step_times_ms": [50.0, 10.0, 10.0]}))
        assert [c.name for c in configs] == ["quickstart.yaml", "llama_8b_offload.yaml"]
        return {"status": "ok", "timed_out": False, "returncode": 0}

    monkeypatch.setattr("lit_fsdp.commands.launch.launch", launch)
    args = args_for(tmp_path, "--peers", "slide_fsdp", "slide_fsdp_exact")
    for peer in args.peers:
        record = bench_peers.run_peer(peer, Shape.of("llama-tiny", 2), args, 20.0, (None, None))
        assert record["status"] == "ok" and record["tokens_per_s"] == pytest.approx(256 * 2 / 0.02)
        assert record["offload"] == {"offload_cpu_update_ms": 3.0} and record["host_needed_gib"] is None
    shipped, exact = calls
    for call in calls:
        adamw = (call["--model.learning_rate"], call["--model.betas"], call["--model.weight_decay"])
        assert adamw == ("0.0001", "[0.9, 0.95]", "0.1")
        constant = (call["--trainer.gradient_clip_val"], call["--model.warmup_steps"], call["--model.min_lr_ratio"])
        assert constant == ("1.0", "0", "1.0")
        assert (call["--data.seq_len"], call["--data.batch_size"], call["--trainer.devices"]) == ("64", "2", "2")
        assert json.loads(call["--model.config_overrides"]) == {"num_hidden_layers": 2}
        assert call["--trainer.strategy.init_args.compile_blocks"] == "false"  # on the CPU only
        assert json.loads(call["--trainer.callbacks"])[0]["init_args"] == {"warmup_steps": 0}  # every step's time
    assert not any(key.startswith("--trainer.strategy.init_args.update") for key in shipped)  # as shipped
    assert (exact["--trainer.strategy.init_args.update"],
            exact["--trainer.strategy.init_args.optimizer_state_dtype"]) == ("synchronous", "float32")


def test_a_rank_records_its_own_error_and_the_row_takes_it(tmp_path, monkeypatch):
    def failed(argv, folder, timeout, env):
        (folder / "rank1.json").write_text(json.dumps({"rank": 1, "error": "RuntimeError: gloo lost rank 0"}))
        return 1, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"

    monkeypatch.setattr(bench_peers, "run_group", failed)
    record = bench_peers.run_peer("fsdp2_cpu_offload", Shape.of("llama-tiny", 2), args_for(tmp_path), 20.0, (None, None))
    assert record["status"] == "failed" and record["error"] == "RuntimeError: gloo lost rank 0"


def test_main_appends_a_json_line_a_peer_and_prints_the_table_with_refusals_and_missing_deepspeed(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_peers, "deepspeed_installed", lambda: False)
    monkeypatch.setattr(bench_peers, "worker_run", lambda *a: pytest.fail("a refused peer must not start"))
    out = tmp_path / "peers.jsonl"
    argv = ["--device", "cpu", "--preset", "llama-8b", "--layers", "32", "--peers", "deepspeed_zero3_offload",
            "fsdp2_cpu_offload", "--host-memory-gb", "64", "--out", str(out)]
    assert bench_peers.main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["peer"], r["status"]) for r in records] == [("deepspeed_zero3_offload", "refused"),
                                                           ("fsdp2_cpu_offload", "refused")]
    assert records[1]["error"].startswith("needs 119.7 GiB of host memory (16 B/param x 8.03e9 parameters")
    lines = capsys.readouterr().out.splitlines()
    assert lines[-4].startswith("| model | peer | status |") and lines[-1].startswith("| llama-8b x32 (8.03B) |")
    # where deepspeed is missing, its peers are a row saying so, not a crash
    assert bench_peers.main(["--device", "cpu", "--peers", "deepspeed_zero2_offload", "--out", str(out)]) == 0
    missing = json.loads(out.read_text().splitlines()[-1])
    assert (missing["status"], missing["error"]) == ("failed", "deepspeed is not installed; pip install -e '.[peers]'")


def test_the_table_names_the_warmup_left_out_and_lists_every_step():
    record = {"peer": "slide_fsdp", "preset": "llama-8b", "layers": 8, "parameters": 2.8e9, "status": "ok",
              "tokens_per_s": 8493.2, "mfu": 0.414, "device_peak_gib": 29.8, "host_peak_rss_gib": 70.25,
              "steps_measured": 3, "warmup_steps_left_out": 2, "step_times_ms": [20100.0, 8000.4, 7712.0, 7716.6, 7720.0]}
    assert table([record]).splitlines() == [
        "| model | peer | status | tokens/s | MFU | device peak GiB | host peak RSS GiB | steps measured | every step's ms |",
        "|---|---|---|---|---|---|---|---|---|",
        "| llama-8b x8 (2.8B) | slide_fsdp | ok | 8,493 | 41.4% | 29.80 | 70.25 | 3 (first 2 left out) | "
        "20100, 8000, 7712, 7717, 7720 |"]


def test_bad_arguments_are_one_line_errors_that_name_the_fix():
    for argv, message in ((["--warmup", "3", "--steps", "3"], "--warmup 3 with --steps 3: leave out fewer steps"),
                          (["--layers", "0"], "--layers 0: give a number of blocks (1 or more) or auto")):
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_peers.py"), "--device", "cpu", *argv],
                              capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr.splitlines()[-1]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install -e '.[peers]'): the peers' CPU "
                                             "run needs it; .ci/run installs it after the main suite")
def test_the_cpu_mode_runs_every_peer_end_to_end_or_says_why_it_cannot_run_on_a_cpu(tmp_path):
    out = tmp_path / "peers.jsonl"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_peers.py"), "--device", "cpu", "--out", str(out),
                           "--work", str(tmp_path / "runs")], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    records = {r["peer"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == sorted(set(PEERS) - set(bench_peers.CPU_SKIPS))
    for name, record in records.items():
        if name in CANNOT_RUN_ON_CPU:
            assert record["status"] == "failed" and CANNOT_RUN_ON_CPU[name] in record["error"], record
            continue
        assert record["status"] == "ok", (name, record.get("error"))
        assert len(record["step_times_ms"]) == 3 and record["steps_measured"] == 2 and record["tokens_per_s"] > 0
        assert record["mfu"] is None and record["host_peak_rss_gib"] > 0 and record["tokens_per_step"] == 256
    # the same seeded weights and token ids under every peer of peers_worker.py: the same first loss (bfloat16 compute)
    first = {name: r["losses"][0] for name, r in records.items() if r["status"] == "ok" and r.get("losses")}
    assert len(first) == 3 and max(first.values()) - min(first.values()) < 1e-3 * min(first.values()), first
    table_lines = [line for line in done.stdout.splitlines() if line.startswith("| llama-tiny x2")]
    assert len(table_lines) == 2 * len(records)  # a line as each peer ends, then the table
