"""Running the real CLI in a subprocess and reading what it logged."""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.distributed.device_mesh import DeviceMesh

from compress.config import CompressionConfig
from lit_fsdp.model import CausalLM
from lit_fsdp.strategy import FSDP2Strategy
from lit_fsdp.commands.tune.memory import ModelShape
from tests.distributed import fit_in_process, free_port, run

REPO = Path(__file__).resolve().parents[1]

# A few steps of a tiny model, logged every step to CSV, no progress bar, no validation.
FAST = [
    "--config", str(REPO / "configs" / "quickstart.yaml"),
    "--trainer.limit_val_batches", "0",
    "--trainer.log_every_n_steps", "1",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--model.warmup_steps", "2",
]


def run_cli(*args: str, cwd: Path, check: bool = True, nodes: int = 1) -> subprocess.CompletedProcess:
    """``python -m lit_fsdp *args`` in ``cwd``; with ``check``, fail the test with its output on error.

    With ``nodes`` > 1, one process per node is started on this machine with Lightning's multi-node
    variables (one device per node); the result is node 0's, with every node's return code checked.
    """
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "lit_fsdp", *args]
    if nodes == 1:
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    else:
        port = str(free_port())
        processes = [
            subprocess.Popen(
                [*command, "--trainer.num_nodes", str(nodes), "--trainer.devices", "1"], cwd=cwd, text=True,
                env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node), "LOCAL_RANK": "0"},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
            for node in range(nodes)
        ]
        outputs = [process.communicate(timeout=600) for process in processes]
        codes = [process.returncode for process in processes]
        result = subprocess.CompletedProcess(command, max(codes, key=abs), *outputs[codes.index(max(codes, key=abs))])
    if check and result.returncode != 0:
        raise AssertionError(f"lit_fsdp {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def cli_in_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m lit_fsdp *args`` run in this process from ``cwd``, for what stops before training (a refusal, a
    listing): its exit status and what it printed, as ``run_cli(..., check=False)`` gives them, without a process's
    start-up (10 to 20 s on 2 cores). A command that reaches training fails the test: that needs ``run_cli``, whose
    launcher starts the ranks."""
    from lightning.pytorch import Trainer

    from lit_fsdp.commands.main import main

    def stop(method: Any) -> Any:  # the method's signature kept: LightningCLI builds its subcommand's options from it
        @functools.wraps(method)
        def past_the_preflight(*_: Any, **__: Any) -> None:
            raise AssertionError(f"lit_fsdp {' '.join(args)} went past its preflight: run it with run_cli")
        return past_the_preflight

    out, err, status, here = io.StringIO(), io.StringIO(), 0, os.getcwd()
    os.chdir(cwd)
    try:
        with (mock.patch.object(Trainer, "fit", stop(Trainer.fit)), mock.patch.object(Trainer, "validate", stop(Trainer.validate)),
              contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)):
            main(list(args))
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    finally:
        os.chdir(here)
    assert not torch.distributed.is_initialized(), f"lit_fsdp {' '.join(args)} started a process group in this process"
    return subprocess.CompletedProcess(["lit_fsdp", *args], status, out.getvalue(), err.getvalue())


def fit_arguments(
    tmp: Path, *args: str, devices: int = 2, batch_size: int = 2, steps: int = 6, callbacks: list[dict] | None = None
) -> list[str]:
    """``fit`` arguments for a short run logged to CSV in ``tmp``; ``callbacks`` replace the config's callbacks."""
    tmp.mkdir(parents=True, exist_ok=True)
    extra_config = tmp / f"callbacks{len(list(tmp.glob('callbacks*.yaml')))}.yaml"
    extra_config.write_text(json.dumps({"trainer": {"callbacks": callbacks or []}}))
    return [
        "fit", *FAST, "--config", str(extra_config),
        "--trainer.devices", str(devices),
        "--data.batch_size", str(batch_size),
        "--trainer.max_steps", str(steps),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(tmp),
        *args,
        "--trainer.default_root_dir", str(tmp),  # last: the method configs name their own run folder
    ]


def fit(
    tmp: Path, *args: str, devices: int = 2, batch_size: int = 2, steps: int = 6, callbacks: list[dict] | None = None,
    nodes: int = 1,
) -> dict[str, list[float]]:
    """A short fit logged to ``tmp``; returns each logged metric as a list over steps.

    ``callbacks`` (``{"class_path": ..., "init_args": ...}`` dicts) replace the config's callbacks. The ranks run the
    CLI in processes forked from the preloaded forkserver (``tests.distributed.fit_in_process``), where a CLI process
    per rank would import for about 9 s each; the launcher's own path is run by the tests that read its output
    (``run_cli``). With ``nodes`` > 1 there are that many "nodes" of one CLI process each on this machine (``devices``
    is ignored).
    """
    arguments = fit_arguments(tmp, *args, devices=devices, batch_size=batch_size, steps=steps, callbacks=callbacks)
    if nodes == 1:
        run(fit_in_process, tmp, [arguments], world=devices, cwd=tmp)
    else:
        run_cli(*arguments, cwd=tmp, nodes=nodes)
    return read_metrics(max(tmp.glob("lightning_logs/version_*/metrics.csv")))


def read_metrics(path: Path) -> dict[str, list[float]]:
    """Per-step values of each metric in a CSVLogger file (rows without the metric skipped)."""
    metrics: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value and key not in ("step", "epoch"):
                    metrics.setdefault(key, {})[int(row["step"])] = float(value)
    return {key: [by_step[s] for s in sorted(by_step)] for key, by_step in metrics.items()}


# Shared by several test files (a test file never imports another).

# Runs: callbacks given by class path, the batches they record, the export of a checkpoint.
def checkpoint_every(step: int, dirpath) -> dict:
    return {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(dirpath), "save_last": True, "every_n_train_steps": step, "save_top_k": -1},
    }


def gpu_run_result(window: str, run: str) -> dict:
    """The results record (results.jsonl's line) of training run ``run`` in a GPU window's summaries,
    ``docs/gpu_runs/<window>/*summary*.json``: the first that has one (a run cut by its deadline may have none)."""
    for summary in sorted((REPO / "docs" / "gpu_runs" / window).glob("*summary*.json")):
        for step in json.loads(summary.read_text()):
            if step["step"] == run and "result" in step[run]:
                return step[run]["result"]
    raise LookupError(f"no finished run {run!r} in docs/gpu_runs/{window}")


def record(path) -> dict:
    return {"class_path": "tests.probes.RecordBatches", "init_args": {"path": str(path)}}


def digests(path, rank: int) -> list[str]:
    return [json.loads(line)["digest"] for line in open(f"{path}.rank{rank}.jsonl")]


def assert_export_gives_logits(checkpoint, logits_file, tmp_path) -> None:
    """``lit_fsdp export`` of ``checkpoint`` loads with ``from_pretrained`` and gives the logits a SaveLogits probe saved."""
    from transformers import AutoModelForCausalLM

    run_cli("export", str(checkpoint), str(tmp_path / "hf"), cwd=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    saved = torch.load(logits_file)
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-5)


# Compression: a heavy-tailed gradient for a shard of odd size.
SHARD = 1237  # odd, so chunks and packed bits do not divide evenly


def gradient(rank: int, numel: int) -> torch.Tensor:
    """Gaussian noise with a few large coordinates shared by all ranks, as heavy-tailed gradients have."""
    noise = torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))
    noise[::61] += 30.0
    return noise


def payload_bytes(config: dict, n: int, kept: int = 0, call: int = 0) -> int:
    """Bytes one rank sends for a row of ``n`` float32 gradient values under ``config`` (``CompressionConfig`` fields),
    from each format's definition; ``kept``: what a threshold keeps, ``call``: the row's call, for DGC's warm-up."""
    p = CompressionConfig(**config).parameters()
    method, bitmap = config["method"], -(-n // 8)
    chunks = -(-n // p["chunk_size"]) if "chunk_size" in p else 0
    if method in ("topk", "randomk", "thresholdv"):
        ratio, warmup = p.get("ratio"), p.get("warmup_steps")
        if warmup and call < warmup:  # DGC: the density falls from 1 to ratio, exponentially
            ratio = ratio ** (call / warmup)
        k = kept if method == "thresholdv" else max(1, round(ratio * n)) if ratio is not None else min(p["k"], n)
        values = payload_bytes({"method": config["quantize"]}, k) if config.get("quantize") else 4 * k
        index = 0 if method == "randomk" else min(4 * k, bitmap)  # the cheaper of int32 positions and a bitmap
        return values + index + (8 if method == "thresholdv" else 0)  # threshold-v exchanges its count first
    if method == "lowrank":  # P (rows x rank) and Q (cols x rank) of the row as a matrix about sqrt(n) wide
        cols = min(p["cols"] or math.ceil(math.sqrt(n)), n)
        return 4 * p["rank"] * (-(-n // cols) + cols)
    if method == "sketch":  # the count sketch, then the candidates' int32 positions and fp32 values
        k = max(1, round(p["heavy_ratio"] * n))
        return 4 * p["rows"] * math.ceil(p["ratio"] * n / p["rows"]) + 8 * k
    if method == "sparseloco":  # k per chunk: a low byte and the high bits of a log2(chunk) position, a code, a scale
        k = sum(min(p["k"], n - start) for start in range(0, n, p["chunk_size"]))
        high = math.ceil(math.log2(p["chunk_size"])) - 8
        return k + -(-k * high // 8) + -(-k * p["num_bits"] // 8) + 4 * chunks
    return {
        "fp16": 2 * n, "bf16": 2 * n,  # native reduce-scatter of 2-byte values
        "fp8": n + 4 * chunks,  # a byte per value, an fp32 scale per chunk
        "int8": -(-n * p.get("num_bits", 0) // 8) + 4 * chunks,  # num_bits per value, an fp32 scale per chunk
        "qsgd": -(-n * (2 * p.get("levels", 0)).bit_length() // 8) + 4 * chunks,  # a level in [-l, l], a norm per chunk
        "natural": n + bitmap,  # an exponent byte and a sign bit per value
        "signsgd": bitmap + 4 * chunks, "onebit": bitmap + 8 * chunks,  # sign bits, one or two fp32 per chunk
    }[method]


# gpt2-tiny sharded by the real strategy on CPU processes, without a Trainer, and a loss on random tokens.
BATCH, SEQ = 2, 32


class CPUStrategy(FSDP2Strategy):
    """The real strategy without a Trainer: the mesh is set from outside and the device is the CPU."""

    root_device = torch.device("cpu")


def sharded_model(rank: int, world: int, mesh: DeviceMesh, sharding: str = "FULL_SHARD",
                  compression: CompressionConfig | None = None, preset: str = "gpt2-tiny", lora: dict | None = None,
                  pretrained_path: str | None = None, **strategy_args: Any) -> tuple[CausalLM, CPUStrategy]:
    """``preset`` or the folder ``pretrained_path`` (seed 0, with ``lora``'s adapters) sharded, initialised and given
    its comm hooks by ``FSDP2Strategy.place``, as in a run."""
    torch.manual_seed(0)
    module = CausalLM(preset=preset, pretrained_path=pretrained_path, lora=lora)
    module.configure_model()
    strategy = CPUStrategy(sharding=sharding, compression=compression, **{"param_dtype": "float32", **strategy_args})
    strategy._device_mesh = mesh
    environment = LightningEnvironment()
    environment.set_world_size(world)
    environment.set_global_rank(rank)
    strategy.cluster_environment = environment
    strategy._lightning_module = module
    strategy.place(module.model, module)
    return module, strategy


def optimizer_for(module: CausalLM, strategy: CPUStrategy, lr: float = 3e-3) -> torch.optim.Optimizer:
    """AdamW, or the optimizer the strategy's compression replaces it with (1-bit Adam's), as a run builds it."""
    params = list(module.model.parameters())
    return strategy.replacement_optimizer(params, lr=lr) or torch.optim.AdamW(params, lr=lr)


def batch(generator: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(module: CausalLM, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(module(inputs).float().flatten(0, 1), labels.flatten())


# gpt2-tiny with a 512-token vocabulary, counted by hand: a block is ln_1 (128) + c_attn (64 x 192 + 192)
# + attn c_proj (64 x 64 + 64) + ln_2 (128) + c_fc (64 x 256 + 256) + mlp c_proj (256 x 64 + 64) = 49,984;
# the root is wte and wpe (512 x 64 each) + ln_f (128); the head is tied to wte.
BLOCK, ROOT, LAYERS, HIDDEN, INNER, VOCAB = 49_984, 2 * 512 * 64 + 128, 2, 64, 256, 512
TINY = ModelShape(parameters=LAYERS * BLOCK + ROOT, block_parameters=BLOCK, root_parameters=ROOT, layers=LAYERS,
                  hidden=HIDDEN, intermediate=INNER, vocab=VOCAB, gated_mlp=False)


# Fine-tuning: the shipped chat sample, and a pretrained folder to fine-tune on it.
SFT_SAMPLES = REPO / "lit_fsdp" / "data" / "samples" / "reverse_words"


def save_sft_base(folder: Path) -> Path:
    """A pretrained folder as ``export`` writes one: a tiny GPT-2 and a 400-token BPE trained on the sample's text."""
    from transformers import AutoModelForCausalLM

    from lit_fsdp.data.chat import read_samples
    from lit_fsdp.data.tokenizer import train_bpe
    from lit_fsdp.presets import build_config

    texts = [" ".join(content for _, content in sample.turns) for sample, _ in read_samples(SFT_SAMPLES / "train.jsonl")]
    tokenizer = train_bpe(texts[:1000], 400)
    tokenizer.save_pretrained(folder)
    config = build_config("gpt2-tiny", {"vocab_size": len(tokenizer), "n_positions": 128})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, safe_serialization=True)
    return folder
