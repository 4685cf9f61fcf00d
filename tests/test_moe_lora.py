"""LoRA on a mixture of experts (``--model.lora``'s ``target_parameters``, lit_fsdp/lora_parameters.py): adapters on
the fused 3D expert tensors beside the attention's, by default; exact at the start, as peft computes them; trained
under FSDP2 and SlideFSDP; exported merged (transformers) and in peft's format.

In this process: the defaults, the refusals, and the adapted model against peft's on tiny Qwen3-MoE and Mixtral
checkpoints (tests/moe.py). One spawn of 2 gloo processes runs the real CLI in-process: a few LoRA steps of the
Qwen3-MoE checkpoint (one tensor per expert on disk) under FSDP2, then under SlideFSDP; both exports read its
checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from lit_fsdp import lora, lora_parameters
from lit_fsdp.errors import OneLineError
from lit_fsdp.model import CausalLM
from tests.distributed import in_process_cli, run
from tests.helpers import REPO, cli_in_process, fit_arguments, read_metrics
from tests.moe import moe_config, write_moe_checkpoint

peft = pytest.importorskip("peft")

RANK, STEPS = 4, 3
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy", "--trainer.strategy.init_args.window", "1",
         "--trainer.strategy.init_args.update", "forward"]


# --- targets, in this process --------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_defaults_adapt_the_attention_and_the_experts_but_not_the_router(family):
    config = moe_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    paths = lora.attach(model, lora.LoraConfig(rank=RANK))
    layers = range(config.num_hidden_layers)
    assert paths == [*(f"model.layers.{i}.{name}" for i in layers for name in ATTENTION),
                     *(f"model.layers.{i}.{name}" for i in layers for name in EXPERTS)]
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert trained["model.layers.0.mlp.experts.gate_up_proj_lora_A"].shape == (RANK * 4, 32)  # (rank x experts) x in
    assert trained["model.layers.0.mlp.experts.gate_up_proj_lora_B"].shape == (experts.gate_up_proj.shape[1], RANK * 4)
    assert set(trained) == lora.adapter_names(model) == lora.trained_names(model)
    assert not any("mlp.gate." in name for name in trained)
    assert sum(p.numel() for p in trained.values()) == lora.adapter_parameters(config, {"rank": RANK}) \
        == lora.trained_parameters(config, {"rank": RANK})
    expert_weights = sum(model.get_parameter(path).numel() for path in paths if path.endswith(EXPERTS))
    assert lora.trained_matrices(config, {"rank": RANK}) == expert_weights  # their adapted weights get a gradient
    attention = sum(p.numel() for name, p in trained.items() if ".self_attn." in name)
    assert lora.adapter_parameters(config, {"rank": RANK, "target_parameters": []}) == attention  # [] turns them off


def test_an_unknown_target_parameter_is_refused_in_one_line_listing_the_candidates(tmp_path):
    with pytest.raises(OneLineError) as error:
        CausalLM(preset="qwen3-moe-tiny", lora={"target_parameters": ["experts.up_proj"]})
    message = str(error.value)
    assert "\n" not in message and "experts.up_proj" in message
    assert "['mlp.experts.down_proj', 'mlp.experts.gate_up_proj', 'mlp.gate.weight']" in message
    with pytest.raises(OneLineError, match="^--model.lora dropout=0.1 .*set dropout 0, or target_parameters"):
        CausalLM(preset="qwen3-moe-tiny", lora={"dropout": 0.1})
    result = cli_in_process("fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--model.preset",
                            "qwen3-moe-tiny", "--model.lora", "{target_parameters: [experts.up_proj]}", cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "experts.up_proj" in errors[0] and "mlp.experts.gate_up_proj" in errors[0]


# --- the adapted model against peft's, in this process -------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_adapters_start_exact_and_give_peft_and_the_merged_model_their_logits(family, tmp_path):
    base = write_moe_checkpoint(tmp_path / "base", family)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    inputs = torch.arange(24).view(2, 12)
    # the router too (a 2D weight, one "expert" in peft's terms), beside the defaults
    config = lora.LoraConfig(rank=RANK, target_parameters=[*EXPERTS, "mlp.gate.weight"])
    with torch.no_grad():
        plain = model(input_ids=inputs).logits
        lora.attach(model, config, device="cpu")
        lora.init_adapters(model, seed=0)
        assert torch.equal(model(input_ids=inputs).logits, plain)  # B = 0: the base's logits, bit for bit
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):  # as after training
                param.normal_(std=0.1)
        adapted = model(input_ids=inputs).logits
    assert (adapted - plain).abs().max() > 1e-2

    adapter_config, tensors = lora.peft_adapter(model, config, str(base))
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config))
    save_file(tensors, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    fresh = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    peft_model = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    assert set(peft.utils.get_peft_model_state_dict(peft_model)) == set(tensors)  # every adapter read, under its name
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=inputs).logits, adapted, rtol=1e-5, atol=1e-5)

    lora.merge(model)
    model.save_pretrained(tmp_path / "merged")
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=inputs).logits, adapted, rtol=1e-5, atol=1e-5)


def test_a_compiled_moe_block_adds_the_expert_adapters_as_the_eager_one_does():
    """``compile_blocks``: dynamo traces the hooks that swap the adapted weights in and out (its eager backend here,
    as tests/test_lora.py compiles a block)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config("qwen3_moe"))
    lora.attach(model, lora.LoraConfig(rank=RANK), device="cpu")
    lora.init_adapters(model, seed=0)
    block, x = model.model.layers[0], torch.randn(2, 12, 32)
    position = model.model.rotary_emb(x, torch.arange(12).unsqueeze(0))
    compiled = torch.compile(block, backend="eager")
    for _ in range(2):  # B zero, then as after training
        torch.testing.assert_close(compiled(x, position_embeddings=position), block(x, position_embeddings=position),
                                   rtol=0, atol=0)
        with torch.no_grad():
            block.mlp.experts.gate_up_proj_lora_B.normal_()
    assert not [name for module in model.modules() for name in module.__dict__ if name in module._parameters]


class TransposedExperts(nn.Module):
    """Experts held in x out (``is_transposed``, as gpt-oss holds them), each a plain matmul."""

    is_transposed = True

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("eti,eio->eto", x, self.weight)


def test_experts_held_in_by_out_take_peft_s_transposed_delta():
    torch.manual_seed(0)
    ours = TransposedExperts()
    theirs = peft.get_peft_model(nn.Sequential(TransposedExperts()), peft.LoraConfig(
        r=2, lora_alpha=3, target_modules=[], target_parameters=["0.weight"]))
    wrapper = theirs.base_model.model[0]
    with torch.no_grad():
        wrapper.base_layer.weight.copy_(ours.weight)
        wrapper.lora_B["default"].weight.normal_()
    lora_parameters.attach(ours, "weight", "weight", rank=2, scale=1.5, device="cpu")
    assert ours.weight_lora_A.shape == wrapper.lora_A["default"].weight.shape == (2 * 3, 8)  # (rank x experts) x in
    with torch.no_grad():
        ours.weight_lora_A.copy_(wrapper.lora_A["default"].weight)
        ours.weight_lora_B.copy_(wrapper.lora_B["default"].weight)
        x = torch.randn(3, 4, 8)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


# --- fine-tuned by the CLI, on 2 processes -------------------------------------------------------


def arguments(folder: Path, base: Path, *extra: str, callbacks: list[dict]) -> list[str]:
    """A short LoRA fine-tune (the defaults, rank ``RANK``) of the Qwen3-MoE folder ``base`` on 2 processes."""
    return fit_arguments(folder, "--model.pretrained_path", str(base), "--model.lora", json.dumps({"rank": RANK}),
                         "--data.seq_len", "32", "--model.warmup_steps", "1", *extra, steps=STEPS,
                         callbacks=callbacks)


def fine_tune(rank: int, world: int, root: Path, base: Path) -> None:
    """The FSDP2 run (a checkpoint and the logits at its end), then the SlideFSDP run (its logits)."""
    cli = in_process_cli(rank, world)
    saved = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(root / "fsdp2" / "ckpt"), "every_n_train_steps": STEPS}}
    for name, extra, callbacks in (("fsdp2", [], [saved]), ("slide", SLIDE, [])):
        logits = {"class_path": "tests.probes.SaveLogits", "init_args": {"path": str(root / name / "logits.pt")}}
        cli(arguments(root / name, base, *extra, callbacks=[*callbacks, logits]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("moe_lora")
    base = write_moe_checkpoint(root / "base", "qwen3_moe")  # one tensor per expert on disk, as on the Hub
    run(fine_tune, root, root, base)
    checkpoint = next((root / "fsdp2" / "ckpt").glob(f"*-step={STEPS}.ckpt"))
    return SimpleNamespace(base=base, checkpoint=checkpoint, **{name: SimpleNamespace(
        logits=torch.load(root / name / "logits.pt"),
        metrics=read_metrics(max((root / name).glob("lightning_logs/version_*/metrics.csv"))))
        for name in ("fsdp2", "slide")})


def logits_of(model: nn.Module, saved: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=saved["input_ids"]).logits


def test_the_merged_export_loads_in_transformers_with_the_fine_tuned_logits_and_trained_experts(runs, tmp_path):
    from lit_fsdp.commands.export import export_hf

    export_hf(str(runs.checkpoint), str(tmp_path / "hf"))
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(logits_of(merged, runs.fsdp2.logits), runs.fsdp2.logits["logits"], rtol=1e-5, atol=1e-5)
    # on disk one tensor per expert, as the base: each expert's weights changed by training, the router's did not
    exported, source = load_file(tmp_path / "hf" / "model.safetensors"), load_file(runs.base / "model.safetensors")
    assert set(exported) == set(source)
    changed = {key for key in source if not torch.equal(exported[key], source[key])}
    experts = {key for key in source if ".mlp.experts." in key}
    assert len(experts) == 2 * 4 * 3 and experts <= changed  # 2 layers x 4 experts x gate, up, down
    assert not any(".mlp.gate." in key or "norm" in key for key in changed)


def test_the_adapter_export_loads_in_peft_with_the_fine_tuned_logits(runs, tmp_path):
    from lit_fsdp.commands.export import export_hf

    export_hf(str(runs.checkpoint), str(tmp_path / "adapter"), adapter_only=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == list(EXPERTS)
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert tensors["base_model.model.model.layers.0.mlp.experts.lora_B.weight"].shape == (32, RANK * 4)  # down_proj's
    base = AutoModelForCausalLM.from_pretrained(runs.base, local_files_only=True)
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(logits_of(model, runs.fsdp2.logits), runs.fsdp2.logits["logits"], rtol=1e-5, atol=1e-5)


def test_slide_fsdp_trains_the_expert_adapters_as_fsdp2_does(runs):
    slide, fsdp2 = runs.slide.metrics, runs.fsdp2.metrics
    assert len(slide["train/loss"]) == STEPS
    for key in ("train/loss", "train/grad_norm"):
        assert slide[key] == pytest.approx(fsdp2[key], rel=1e-5), key
    torch.testing.assert_close(runs.slide.logits["logits"], runs.fsdp2.logits["logits"], rtol=1e-5, atol=1e-5)
