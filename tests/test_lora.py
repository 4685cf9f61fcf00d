"""LoRA (``--model.lora``, lit_fsdp/lora.py): adapters on a frozen base sharded by FSDP2, modules trained whole beside
them (``train``), checkpoints that hold only what trains, resume exactly (with dropout too) and refuse another base,
and exports merged (transformers) or in peft's format.

Two spawns of 2 gloo processes: one drives the sharded model directly (the logits at step 0, the frozen base, what
the compression hooks reduce), one runs the real CLI in-process run after run, as tests/test_exact_resume.py does;
a 1-process spawn gives the reference losses.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM

from compress.config import CompressionConfig
from lit_fsdp import lora
from lit_fsdp.errors import OneLineError, RunError
from lit_fsdp.model import CausalLM
from lit_fsdp.presets import build_config
from tests.distributed import in_process_cli, run
from tests.helpers import (REPO, CPUStrategy, batch, cli_in_process, fit_arguments, loss_of, read_metrics,
                           sharded_model)
from tests.probes import SaveLogits

RANK = 4
LORA = ["--model.lora", json.dumps({"rank": RANK})]  # JSON is YAML's flow style
GPT2_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
LLAMA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
STEPS, STOP = 6, 3
# adapters with dropout, and the embeddings (GPT-2's head is tied to wte) and norms trained whole beside them
TRAINED = {"rank": RANK, "dropout": 0.1, "train": ["embeddings", "norms"]}
TRAINED_MODULES = {"wte", "wpe", "ln_1", "ln_2", "ln_f"}


# --- targets and injection, in this process ------------------------------------------------------


def test_default_targets_are_every_linear_layer_of_attention_and_mlp_in_gpt2_and_llama():
    for preset, blocks, names in (("gpt2-tiny", "transformer.h", GPT2_TARGETS), ("llama-tiny", "model.layers", LLAMA_TARGETS)):
        module = CausalLM(preset=preset, lora={})
        module.configure_model()
        assert [path for path, _ in lora.adapted(module.model)] == [f"{blocks}.{i}.{name}" for i in range(2) for name in names]


def test_the_base_keeps_its_parameter_names_and_is_frozen_beside_float32_adapters_in_peft_shapes():
    for preset in ("gpt2-tiny", "llama-tiny"):
        plain, adapted = CausalLM(preset=preset), CausalLM(preset=preset, lora={"rank": RANK})
        plain.configure_model()
        adapted.configure_model()
        assert {key for key in adapted.model.state_dict() if ".lora_" not in key} == set(plain.model.state_dict())
        for name, param in adapted.model.named_parameters():
            is_adapter = name.rpartition(".")[2] in lora.ADAPTERS
            assert param.requires_grad == is_adapter, name
            assert param.is_meta  # built without memory, like the base: the strategy materialises both
            assert not is_adapter or param.dtype == torch.float32
        if preset == "gpt2-tiny":
            conv = adapted.model.get_submodule("transformer.h.0.mlp.c_fc")  # Conv1D: the weight is in x out
            assert conv.weight.shape == (64, 256) and conv.lora_A.shape == (RANK, 64) and conv.lora_B.shape == (256, RANK)
        else:
            linear = adapted.model.get_submodule("model.layers.0.mlp.gate_proj")  # nn.Linear: out x in
            assert linear.weight.shape == (176, 64) and linear.lora_A.shape == (RANK, 64) and linear.lora_B.shape == (176, RANK)


def test_an_unknown_target_is_refused_in_one_line_naming_the_models_linear_modules(tmp_path):
    with pytest.raises(OneLineError) as error:
        CausalLM(preset="gpt2-tiny", lora={"targets": ["q_proj"]})
    assert "\n" not in str(error.value) and "q_proj" in str(error.value) and "'c_attn', 'c_fc', 'c_proj'" in str(error.value)
    result = cli_in_process("fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--model.lora",
                            "{targets: [q_proj]}", cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "q_proj" in errors[0] and "c_attn" in errors[0], result.stderr[-2000:]


def test_an_architecture_without_default_targets_is_refused_in_one_line_naming_its_linear_modules():
    config = AutoConfig.for_model("gpt_neox", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=64)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(OneLineError) as error:
        lora.target_paths(model, lora.LoraConfig())
    message = str(error.value)
    assert "\n" not in message and "gpt_neox" in message and "query_key_value" in message and "dense_h_to_4h" in message
    named = lora.target_paths(model, lora.LoraConfig(targets=["query_key_value"]))
    assert named == ["gpt_neox.layers.0.attention.query_key_value"]


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_merging_the_adapters_into_the_weights_gives_the_adapted_models_logits(preset):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(preset))
    inputs = torch.arange(16).unsqueeze(0)
    lora.attach(model, lora.LoraConfig(rank=RANK), device="cpu")
    lora.init_adapters(model, seed=0)
    with torch.no_grad():
        base = model(input_ids=inputs).logits
        for _, module in lora.adapted(model):
            module.lora_B.normal_(std=0.05)  # trained adapters: B is no longer zero
        adapted = model(input_ids=inputs).logits
        lora.merge(model)  # GPT-2's Conv1D takes (B @ A) transposed
        merged = model(input_ids=inputs).logits
    assert (adapted - base).abs().max() > 1e-2
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == set(AutoModelForCausalLM.from_config(build_config(preset)).state_dict())


def is_trained_module(name: str) -> bool:
    """Whether parameter ``name`` belongs to a module ``TRAINED`` trains whole (the tied head is ``wte``'s)."""
    return name.rpartition(".")[0].rpartition(".")[2] in TRAINED_MODULES


def test_train_leaves_the_named_modules_trainable_beside_the_adapters_and_a_tied_head_trained_once():
    module = CausalLM(preset="gpt2-tiny", lora=TRAINED)
    module.configure_model()
    model = module.model
    for name, param in model.named_parameters():
        assert param.requires_grad == (name.rpartition(".")[2] in lora.ADAPTERS or is_trained_module(name)), name
        assert param.dtype == torch.float32
    assert model.lm_head.weight is model.transformer.wte.weight  # one parameter, in the optimizer once
    trained = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trained) == lora.trained_parameters(build_config("gpt2-tiny"), TRAINED)
    assert "transformer.wte.weight" in lora.trained_names(model) and "lm_head.weight" not in lora.trained_names(model)
    llama = CausalLM(preset="llama-tiny", lora={"train": ["embed_tokens", "norm"]})  # "norm": the final one only
    llama.configure_model()
    assert sorted(n for n, p in llama.model.named_parameters() if p.requires_grad and ".lora_" not in n) == \
        ["model.embed_tokens.weight", "model.norm.weight"]


def test_a_train_name_that_matches_no_module_or_an_adapted_one_is_refused_in_one_line():
    with pytest.raises(OneLineError) as error:
        CausalLM(preset="gpt2-tiny", lora={"train": ["embed_tokens"]})
    message = str(error.value)
    assert "\n" not in message and "embed_tokens" in message and "'embeddings', 'norms'" in message and "'wte'" in message
    with pytest.raises(OneLineError, match=r"train \['attn'\] names .*transformer.h.0.attn.*adapted"):
        CausalLM(preset="gpt2-tiny", lora={"train": ["attn"]})
    with pytest.raises(OneLineError, match="give a list of module names"):
        lora.LoraConfig(train="wte")


def dropout_outputs(model: torch.nn.Module, x: torch.Tensor, *key: int) -> list[torch.Tensor]:
    lora.seed_dropout(model, *key)
    return [lora._dropout(module, x) for _, module in lora.adapted(model)[:2]]


def test_dropout_masks_repeat_for_a_key_and_differ_across_steps_micro_batches_ranks_and_modules():
    model = AutoModelForCausalLM.from_config(build_config("gpt2-tiny"))
    lora.attach(model, lora.LoraConfig(rank=RANK, dropout=0.5, targets=["c_attn", "attn.c_proj"]), device="cpu")
    x = torch.ones(2, 8, 64)
    first, second = dropout_outputs(model, x, 0, 3, 1, 0)  # seed, step, micro-batch, rank
    assert set(first.unique().tolist()) == {0.0, 2.0}  # dropped, or kept and scaled by 1 / (1 - p)
    assert not torch.equal(first, second)  # each module its own mask
    assert torch.equal(dropout_outputs(model, x, 0, 3, 1, 0)[0], first)  # a resume's or a recompute's: the same
    for other in ((1, 3, 1, 0), (0, 4, 1, 0), (0, 3, 0, 0), (0, 3, 1, 1)):
        assert not torch.equal(dropout_outputs(model, x, *other)[0], first), other


def test_a_compiled_block_keeps_its_adapters_and_keyed_dropout_and_a_new_key_does_not_recompile():
    """``compile_blocks`` compiles each block with its adapters' hooks: dynamo traces the adapters and runs the keyed
    dropout eagerly (``torch.compiler.disable``), so each step's new key is no guard. Dynamo's eager backend here: a
    LoRA fit with ``compile_blocks true`` (inductor) matches the eager one but compiles for ~40 s on this CPU."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config("gpt2-tiny"))
    lora.attach(model, lora.LoraConfig(rank=RANK, dropout=0.1, train=["norms"]), device="cpu")
    lora.init_adapters(model, seed=0)
    with torch.no_grad():
        for _, module in lora.adapted(model):
            module.lora_B.normal_(std=0.05)
    block, x = model.transformer.h[0], torch.randn(2, 16, 64)
    compiled = torch.compile(block, backend="eager")
    try:
        for step in range(3):
            lora.seed_dropout(model, 0, step, 0, 0)
            eager = block(x)[0]
            assert torch.equal(compiled(x)[0], eager)
            torch.compiler.set_stance("fail_on_recompile")  # from the second step on
    finally:
        torch.compiler.set_stance("default")


# --- the sharded model, on 2 processes -----------------------------------------------------------


def sharded(rank: int, world: int, preset: str, lora_config: dict | None = None, **strategy_args
            ) -> tuple[CausalLM, CPUStrategy]:
    """``preset`` (seed 0) built on the meta device, sharded, initialised and given its comm hooks as in a run."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    module, strategy = sharded_model(rank, world, mesh, preset=preset, lora=lora_config, **strategy_args)
    # configure_optimizers reads the strategy (1-bit Adam's optimizer) and max_steps (the schedule) from the trainer
    module._trainer = SimpleNamespace(strategy=strategy, max_steps=STOP)
    return module, strategy


def shard_digests(module: CausalLM) -> dict[str, str]:
    return {name: hashlib.sha256(p.to_local().detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, p in module.model.named_parameters()}


def train_steps(rank: int, world: int, lora_config: dict, **strategy_args) -> dict:
    """What a few steps of gpt2-tiny with ``lora_config`` change and send."""
    module, strategy = sharded(rank, world, "gpt2-tiny", lora_config, **strategy_args)
    before = shard_digests(module)
    optimizer = module.configure_optimizers()["optimizer"]
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    sent, losses = [], []
    for _ in range(STOP):
        loss = loss_of(module, *batch(data, module.model.config.vocab_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = strategy.comm_hook.stats.take()
        sent.append((stats["numel"], stats["bytes_raw"]))
        losses.append(float(loss))
    return {"before": before, "after": shard_digests(module), "sent": sent, "losses": losses,
            "optimizer": type(optimizer).__name__, "dtypes": sorted({str(p.dtype) for p in module.model.parameters()}),
            "optimized": [p.numel() for group in optimizer.param_groups for p in group["params"]]}


def train_adapters(rank: int, world: int) -> dict:
    """Step-0 logits of base and LoRA model; then, per compression method, what a few LoRA steps change and send; and
    the same with modules trained whole beside the adapters."""
    inputs = torch.arange(32).view(2, 16)
    same_start = {}
    for preset in ("gpt2-tiny", "llama-tiny"):
        with torch.no_grad():
            base_logits = sharded(rank, world, preset)[0](inputs)
            same_start[preset] = torch.equal(base_logits, sharded(rank, world, preset, {"rank": RANK})[0](inputs))
    runs = {method: train_steps(rank, world, {"rank": RANK}, **strategy_args) for method, strategy_args in {
        "int8": {"compression": CompressionConfig(method="int8")},
        "onebit_adam": {"compression": CompressionConfig(method="onebit_adam", freeze_step=1)},
        # bfloat16 compute: FSDP2 gathers base and adapters in bfloat16; the sharded adapters stay float32
        "bf16+checkpointing": {"compression": CompressionConfig(method="int8"), "param_dtype": "bfloat16",
                               "activation_checkpointing": 1},
    }.items()}
    trained = train_steps(rank, world, {**TRAINED, "dropout": 0.0}, compression=CompressionConfig(method="int8"))
    return {"same_start": same_start, "runs": runs, "trained": trained}


@pytest.fixture(scope="module")
def adapter_training(tmp_path_factory) -> list[dict]:
    return run(train_adapters, tmp_path_factory.mktemp("adapters"))


def adapter_elements(world: int) -> tuple[int, int]:
    """gpt2-tiny's adapter elements at ``RANK``: as FSDP2 pads them in its reduce-scatter (rows to a multiple of
    ``world``), and in all."""
    module = CausalLM(preset="gpt2-tiny", lora={"rank": RANK})
    module.configure_model()
    adapters = [p for p in module.model.parameters() if p.requires_grad]
    padded = sum(math.ceil(p.shape[0] / world) * world * math.prod(p.shape[1:]) for p in adapters)
    return padded, sum(p.numel() for p in adapters)


def test_a_lora_model_starts_with_its_bases_logits(adapter_training):
    for result in adapter_training:
        assert result["same_start"] == {"gpt2-tiny": True, "llama-tiny": True}


def test_steps_change_the_adapters_and_leave_the_sharded_base_unchanged(adapter_training):
    _, total = adapter_elements(2)
    for result in adapter_training:
        for method, trained in result["runs"].items():
            before, after = trained["before"], trained["after"]
            changed = sorted(name for name in before if before[name] != after[name])
            assert changed == sorted(name for name in before if name.rpartition(".")[2] in lora.ADAPTERS), method
            assert all(math.isfinite(loss) for loss in trained["losses"]), method
            assert sum(trained["optimized"]) == total, method  # the optimizer holds the adapters (DTensors) only
            assert trained["dtypes"] == ["torch.float32"], method  # sharded: float32 masters, for the optimizer too
        assert result["runs"]["onebit_adam"]["optimizer"] == "OneBitAdam"  # the 1-bit Adam replacement still applies


def test_compression_hooks_reduce_only_the_adapters_gradients(adapter_training):
    padded, _ = adapter_elements(2)
    whole = sum(math.ceil(p.shape[0] / 2) * 2 * math.prod(p.shape[1:]) for p in _gpt2_tiny_parameters())
    assert padded < whole / 10
    for result in adapter_training:
        for method, trained in result["runs"].items():
            # one reduce-scatter per block; the root (embeddings, final norm) holds nothing to train and reduces nothing
            assert trained["sent"] == [(padded, padded // 2 * 4)] * STOP, method  # raw: the other rank's half, fp32


def test_modules_trained_beside_the_adapters_are_sharded_trained_and_reduced_with_them(adapter_training):
    module = CausalLM(preset="gpt2-tiny", lora=TRAINED)
    module.configure_model()
    trained_elements = sum(math.ceil(p.shape[0] / 2) * 2 * math.prod(p.shape[1:])
                           for p in module.model.parameters() if p.requires_grad)
    for result in adapter_training:
        trained = result["trained"]
        before, after = trained["before"], trained["after"]
        changed = sorted(name for name in before if before[name] != after[name])
        assert changed == sorted(name for name in before if name.rpartition(".")[2] in lora.ADAPTERS
                                 or is_trained_module(name))
        assert trained["dtypes"] == ["torch.float32"] and all(math.isfinite(loss) for loss in trained["losses"])
        assert sum(trained["optimized"]) == lora.trained_parameters(build_config("gpt2-tiny"), TRAINED)
        # every unit reduces what it trains, the root (embeddings, final norm) too
        assert [numel for numel, _ in trained["sent"]] == [trained_elements] * STOP


def _gpt2_tiny_parameters() -> list[torch.Tensor]:
    module = CausalLM(preset="gpt2-tiny")
    module.configure_model()
    return list(module.model.parameters())


# --- real runs through the CLI -----------------------------------------------------------------


class ShardDigests(pl.Callback):
    """At the end of fit, writes a SHA-256 of each of this rank's parameter shards to ``<path>.rank<r>``."""

    def __init__(self, path: str):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        Path(f"{self.path}.rank{trainer.global_rank}").write_text(json.dumps(shard_digests(pl_module)))


class SaveEvalLogits(SaveLogits):
    """SaveLogits in eval mode: without LoRA's dropout, the logits of the fine-tuned model an export gives."""

    def on_train_end(self, trainer, pl_module):
        pl_module.eval()
        super().on_train_end(trainer, pl_module)


def arguments(folder: Path, base: Path, *extra: str, adapters: bool = True, callbacks: list[dict] = (), devices: int = 2,
              batch_size: int = 2, lora_config: dict | None = None, steps: int = STEPS) -> list[str]:
    """A short LoRA fine-tune (``lora_config``, default rank ``RANK``) of the gpt2-tiny folder ``base``, logged to CSV
    in ``folder``, digests at the end (before any SaveLogits: its forward leaves the root unit gathered)."""
    digests = {"class_path": f"{__name__}.ShardDigests", "init_args": {"path": str(folder / "digests")}}
    lora_arguments = ["--model.lora", json.dumps(lora_config)] if lora_config else LORA
    return fit_arguments(folder, "--model.pretrained_path", str(base), *(lora_arguments if adapters else []), *extra,
                         steps=steps, devices=devices, batch_size=batch_size, callbacks=[digests, *callbacks])


def saved_every(step: int, folder: Path) -> dict:
    return {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(folder), "every_n_train_steps": step, "save_top_k": -1}}


STOP_AT = {"class_path": "tests.probes.StopAtStep", "init_args": {"step": STOP}}
FULL_FILE = ["--trainer.strategy.init_args.save_distributed_checkpoint", "false"]


def fine_tune(rank: int, world: int, root: Path, base: Path, other_base: Path) -> dict[str, str]:
    """Every CLI run, in the same order on both ranks; returns the one-line refusals of the runs that must fail."""
    from lit_fsdp.errors import error_line

    cli = in_process_cli(rank, world)
    logits = {"class_path": "tests.probes.SaveLogits", "init_args": {"path": str(root / "logits.pt")}}
    cli(arguments(root / "whole", base, callbacks=[saved_every(STOP, root / "ckpt"), logits]))
    middle = str(next((root / "ckpt").glob(f"*-step={STOP}.ckpt")))
    cli(arguments(root / "resumed", base, "--ckpt_path", middle))
    cli(arguments(root / "full_file", base, *FULL_FILE, callbacks=[saved_every(STOP, root / "full_ckpt"), STOP_AT]))
    cli(arguments(root / "full_file_resumed", base, *FULL_FILE, "--ckpt_path",
                  str(next((root / "full_ckpt").glob(f"*-step={STOP}.ckpt")))))
    # modules trained beside the adapters, with dropout: 4 steps, and the same stopped at step 2 and resumed
    logits = {"class_path": f"{__name__}.SaveEvalLogits", "init_args": {"path": str(root / "trained_logits.pt")}}
    cli(arguments(root / "trained", base, lora_config=TRAINED, steps=4,
                  callbacks=[saved_every(2, root / "trained_ckpt"), logits]))
    cli(arguments(root / "trained_resumed", base, "--ckpt_path", str(next((root / "trained_ckpt").glob("*-step=2.ckpt"))),
                  lora_config=TRAINED, steps=4))
    refusals = {}
    for name, (folder, adapters) in {"other_base": (other_base, True), "without_lora": (base, False)}.items():
        try:
            cli(arguments(root / name, folder, "--ckpt_path", middle, adapters=adapters))
        except Exception as error:  # noqa: BLE001 - the refusal is what the test reads
            refusals[name] = error_line(error)
    return refusals


def one_process(rank: int, world: int, root: Path, base: Path) -> None:
    from lit_fsdp.commands.cli import run as cli

    os.environ.update(LOCAL_RANK="0", NODE_RANK="0", WORLD_SIZE="1")
    cli(arguments(root / "one", base, devices=1, batch_size=4))


def save_base(folder: Path, seed: int) -> Path:
    """A gpt2-tiny Hugging Face folder with the weights of ``seed``: the pretrained base to fine-tune."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(build_config("gpt2-tiny")).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("lora_runs")
    base, other_base = save_base(root / "base", 0), save_base(root / "other_base", 1)
    refusals = run(fine_tune, root, root, base, other_base)[0]
    run(one_process, root, root, base, world=1)
    return SimpleNamespace(root=root, base=base, other_base=other_base, refusals=refusals)


def losses(folder: Path) -> list[float]:
    return read_metrics(max(folder.glob("lightning_logs/version_*/metrics.csv")))["train/loss"]


def digests(folder: Path) -> list[dict[str, str]]:
    return [json.loads(Path(f"{folder / 'digests'}.rank{rank}").read_text()) for rank in range(2)]


def test_two_processes_fine_tune_as_one_process_does(runs):
    two, one = losses(runs.root / "whole"), losses(runs.root / "one")
    assert len(two) == STEPS and two == pytest.approx(one, rel=1e-4, abs=1e-5)
    assert two[-1] < two[0]


def test_an_adapter_checkpoint_holds_only_the_adapters_and_their_optimizer_state(runs):
    import torch.distributed.checkpoint as dcp

    checkpoint = next((runs.root / "ckpt").glob(f"*-step={STOP}.ckpt"))
    entries = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    tensors = {key: math.prod(entry.size) for key, entry in entries.items() if hasattr(entry, "chunks")}
    weights = [key for key in tensors if key.startswith("state_dict.")]
    assert weights and all(key.rpartition(".")[2] in lora.ADAPTERS for key in weights), weights
    _, adapters = adapter_elements(2)
    assert sum(tensors[key] for key in weights) == adapters
    assert sum(tensors.values()) <= 3 * adapters + len(weights)  # weights, AdamW's two moments, a step count each
    whole_model = sum(p.numel() for p in _gpt2_tiny_parameters()) * 12  # float32 weights and AdamW's two moments
    assert sum(f.stat().st_size for f in checkpoint.iterdir()) < whole_model / 2
    manifest = json.loads((checkpoint / "lit_fsdp_manifest.json").read_text())
    assert manifest["weights"] == "LoRA adapters only, without the frozen base"
    assert manifest["lora"]["base"] == str(runs.base.resolve()) and manifest["lora"]["lora"]["rank"] == RANK


@pytest.mark.parametrize("resumed, layout", [("resumed", "sharded"), ("full_file_resumed", "one full file")])
def test_a_run_resumed_from_an_adapter_checkpoint_equals_the_uninterrupted_run(runs, resumed, layout):
    whole, part = losses(runs.root / "whole"), losses(runs.root / resumed)
    assert part == whole[STOP:], layout  # bit for bit
    assert digests(runs.root / resumed) == digests(runs.root / "whole"), layout
    if layout == "one full file":
        assert losses(runs.root / "full_file") == whole[:STOP]


def test_a_run_training_modules_beside_adapters_with_dropout_resumed_equals_the_uninterrupted_run(runs):
    import torch.distributed.checkpoint as dcp

    whole, part = losses(runs.root / "trained"), losses(runs.root / "trained_resumed")
    assert len(whole) == 4 and part == whole[2:]  # bit for bit: the trained modules, their AdamW state, the masks
    assert digests(runs.root / "trained_resumed") == digests(runs.root / "trained")
    # on 2 processes the base stays as loaded; the adapters and the trained modules change
    frozen = [name for name in digests(runs.root / "whole")[0] if name.rpartition(".")[2] not in lora.ADAPTERS]
    for trained, plain in zip(digests(runs.root / "trained"), digests(runs.root / "whole")):
        assert sorted(name for name in frozen if trained[name] != plain[name]) == \
            sorted(name for name in frozen if is_trained_module(name))
    checkpoint = next((runs.root / "trained_ckpt").glob("*-step=2.ckpt"))
    weights = {key.removeprefix("state_dict.model.") for key in dcp.FileSystemReader(str(checkpoint)).read_metadata()
               .state_dict_metadata if key.startswith("state_dict.")}
    assert {key for key in weights if ".lora_" not in key} == {"transformer.wte.weight", "lm_head.weight"} | {
        f"{path}.{kind}" for path in ("transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1",
                                      "transformer.h.1.ln_2", "transformer.ln_f") for kind in ("weight", "bias")} | {
        "transformer.wpe.weight"}
    manifest = json.loads((checkpoint / "lit_fsdp_manifest.json").read_text())
    assert manifest["weights"] == "LoRA adapters and the modules trained beside them, without the frozen base"


def test_the_exports_of_modules_trained_beside_adapters_give_the_fine_tuned_logits_in_transformers_and_peft(runs, tmp_path):
    from lit_fsdp.commands.export import export_hf

    peft = pytest.importorskip("peft")
    checkpoint = next((runs.root / "trained_ckpt").glob("*-step=4.ckpt"))
    saved = torch.load(runs.root / "trained_logits.pt")
    export_hf(str(checkpoint), str(tmp_path / "hf"))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)(input_ids=saved["input_ids"])
    torch.testing.assert_close(merged.logits, saved["logits"], rtol=1e-5, atol=1e-5)
    with pytest.raises(RunError, match="trained on another base"):  # the record is of the base, not the trained wte
        export_hf(str(checkpoint), str(tmp_path / "other"), base_path=str(runs.other_base))

    export_hf(str(checkpoint), str(tmp_path / "adapter"), adapter_only=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    # peft's own for the same: modules_to_save with the tied head, its weight tying kept
    base = AutoModelForCausalLM.from_pretrained(runs.base, local_files_only=True)
    peft_model = peft.get_peft_model(base, peft.LoraConfig(
        r=RANK, lora_alpha=32, target_modules=list(lora.DEFAULT_TARGETS["gpt2"]), fan_in_fan_out=True,
        modules_to_save=[*(path for path in config["modules_to_save"] if path != "transformer.wte"), "lm_head"],
        ensure_weight_tying=True))
    assert sorted(peft_model.peft_config["default"].modules_to_save) == sorted(config["modules_to_save"])
    assert config["ensure_weight_tying"] is True
    from safetensors.torch import load_file

    ours = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert set(ours) == set(peft.utils.get_peft_model_state_dict(peft_model))
    base = AutoModelForCausalLM.from_pretrained(runs.base, local_files_only=True)
    with torch.no_grad():
        logits = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")(input_ids=saved["input_ids"]).logits
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-5)


def test_an_adapter_checkpoint_is_refused_in_one_line_on_another_base_or_without_lora(runs, tmp_path):
    from lit_fsdp.commands.export import export_hf

    other, plain = runs.refusals["other_base"], runs.refusals["without_lora"]
    assert "trained on another base" in other and str(runs.base.resolve()) in other and "\n" not in other
    assert "holds only LoRA adapters" in plain and "--model.lora" in plain and "\n" not in plain
    checkpoint = next((runs.root / "ckpt").glob(f"*-step={STEPS}.ckpt"))
    with pytest.raises(RunError, match="trained on another base") as error:
        export_hf(str(checkpoint), str(tmp_path / "hf"), base_path=str(runs.other_base))
    assert "--base_path" in str(error.value) and "\n" not in str(error.value)


def test_the_merged_export_loads_in_transformers_with_the_fine_tuned_logits(runs, tmp_path):
    from lit_fsdp.commands.export import export_hf

    export_hf(str(next((runs.root / "ckpt").glob(f"*-step={STEPS}.ckpt"))), str(tmp_path / "hf"))
    saved = torch.load(runs.root / "logits.pt")
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)(input_ids=saved["input_ids"])
        base = AutoModelForCausalLM.from_pretrained(runs.base, local_files_only=True)(input_ids=saved["input_ids"])
    torch.testing.assert_close(merged.logits, saved["logits"], rtol=1e-5, atol=1e-5)
    assert (base.logits - saved["logits"]).abs().max() > 1e-3  # the adapters were trained


def test_the_adapter_export_is_peft_format_and_loads_in_peft_with_the_fine_tuned_logits(runs, tmp_path):
    from safetensors.torch import load_file

    checkpoint = next((runs.root / "ckpt").glob(f"*-step={STEPS}.ckpt"))
    exported = cli_in_process("export", str(checkpoint), str(tmp_path / "adapter"), "--adapter_only", "true", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK and config["lora_alpha"] == 32
    assert config["target_modules"] == ["c_attn", "c_proj", "c_fc"] and config["fan_in_fan_out"] is True
    assert config["base_model_name_or_path"] == str(runs.base.resolve())
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert tensors["base_model.model.transformer.h.0.mlp.c_fc.lora_A.weight"].shape == (RANK, 64)  # (out, in) as nn.Linear
    assert tensors["base_model.model.transformer.h.0.mlp.c_fc.lora_B.weight"].shape == (256, RANK)
    assert len(tensors) == 2 * 2 * len(GPT2_TARGETS)
    peft = pytest.importorskip("peft")
    model = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")  # the base from base_model_name_or_path
    saved = torch.load(runs.root / "logits.pt")
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-5)
