"""Mixture-of-experts checkpoints load, train and count as transformers defines them.

Tiny random Qwen3-MoE and Mixtral checkpoints, written here by the installed transformers in both on-disk layouts
(``tests/moe.py``: one tensor per expert, as on the Hub, and fused), load through transformers' conversion rules into
the model and into its FSDP2 shards with ``from_pretrained``'s logits. One spawn of 2 ranks holds every distributed
check: the sharded loads (experts split unevenly, and fewer experts than ranks), a 2-process fit compared with a
1-process one, and a fit whose router starves an expert on rank 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

import lightning.pytorch as pl

from lit_fsdp import router
from lit_fsdp.checkpoint_layout import checkpoint_state_dict
from lit_fsdp.errors import OneLineError
from lit_fsdp.model import CausalLM
from lit_fsdp.weights import materialize
from lit_fsdp.commands.evaluate import EvaluationData, evaluate
from lit_fsdp.commands.export import export_hf
from lit_fsdp.commands.generate import continue_text
from lit_fsdp.commands.trained import load_trained
from tests.corpus import articles, write_array, write_lines
from tests.distributed import fit_in_process, run
from tests.helpers import REPO, cli_in_process, fit_arguments, read_metrics, sharded_model
from tests.moe import FAMILIES, LAYOUTS, write_moe_checkpoint

STEPS = 4
INPUT = torch.arange(48).reshape(2, 24) * 7 % 512


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("moe")
    return {(family, layout): write_moe_checkpoint(root / f"{family}-{layout}", family, layout)
            for family in FAMILIES for layout in LAYOUTS}


def loaded(folder: Path) -> CausalLM:
    """``folder`` loaded by lit_fsdp in one process (plain tensors), as the strategy fills its shards."""
    module = CausalLM(pretrained_path=str(folder))
    module.configure_model()
    materialize(module.model, torch.device("cpu"))
    module.initialize_weights([])
    return module


def reference_logits(folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder).eval()(INPUT).logits


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_in_either_layout_loads_with_from_pretrained_logits(checkpoints, family, layout):
    folder = checkpoints[family, layout]
    with torch.no_grad():
        logits = loaded(folder).model.eval()(INPUT).logits
    assert torch.equal(logits, reference_logits(folder))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_reverse_conversion_gives_the_hub_layout_back(checkpoints, family):
    """transformers' internal conversion API, both ways: the model's fused state dict under the per-expert names and
    values that save_pretrained wrote."""
    folder = checkpoints[family, "per_expert"]
    on_disk = load_file(str(folder / "model.safetensors"))
    model = loaded(folder).model
    reverted = checkpoint_state_dict(model, model.state_dict())
    assert sorted(reverted) == sorted(on_disk)
    assert any(".experts.0." in name for name in on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(reverted[name], tensor), name


def rewritten(source: Path, target: Path, change) -> Path:
    """A copy of the checkpoint ``source`` whose tensors ``change`` edits (a dict, in place)."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"


@pytest.mark.parametrize("change, expected", [
    (lambda t: t.pop(EXPERT), "4 of mlp.experts.*.gate_proj.weight, 3 of mlp.experts.*.up_proj.weight for "
                              "'model.layers.1.mlp.experts.gate_up_proj'"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}), "holds 'model.layers.0.mlp.extra.weight'"),
    (lambda t: t.update({EXPERT: torch.zeros(3, 32)}), "model.layers.1.mlp.experts.gate_up_proj"),
    (lambda t: t.pop("model.layers.0.mlp.experts.3.down_proj.weight"), "model.layers.0.mlp.experts.down_proj"),
    (lambda t: t.update({"model.norm.weight": torch.zeros(31)}), "'model.norm.weight' of shape [31]"),
], ids=["missing-expert", "unexpected", "mis-shaped-expert", "mis-shaped", "missing-expert-alone"])
def test_a_missing_unexpected_or_mis_shaped_tensor_is_one_line_naming_it(checkpoints, tmp_path, change, expected):
    folder = rewritten(checkpoints["qwen3_moe", "per_expert"], tmp_path / "bad", change)
    with pytest.raises((OneLineError, ValueError)) as error:
        loaded(folder)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_checkpoint_that_does_not_fill_the_model_is_said_once_by_the_launcher(checkpoints, tmp_path):
    folder = rewritten(checkpoints["qwen3_moe", "per_expert"], tmp_path / "bad", lambda t: t.pop(EXPERT))
    result = cli_in_process("fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--model.pretrained_path",
                            str(folder), "--trainer.default_root_dir", str(tmp_path), cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if "gate_up_proj" in line]
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("lit_fsdp: error:")


def test_a_quantized_checkpoint_is_refused_in_one_line_with_how_to_dequantize_it(checkpoints, tmp_path):
    folder = tmp_path / "gpt-oss"
    folder.mkdir()
    config = json.loads((checkpoints["mixtral", "fused"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    result = cli_in_process("fit", "--config", "configs/quickstart.yaml", "--model.pretrained_path", str(folder),
                            cwd=Path(__file__).parents[1])
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "mxfp4" in line]
    assert len(lines) == 1 and "Mxfp4Config(dequantize=True)" in lines[0]


@pytest.mark.filterwarnings("ignore:You are trying to")
def test_the_trained_loss_is_the_language_model_loss_plus_the_models_weighted_auxiliary_loss(checkpoints):
    folder = checkpoints["qwen3_moe", "per_expert"]
    module = loaded(folder)
    labels = torch.roll(INPUT, -1, dims=1)
    trained = module.training_step({"input_ids": INPUT, "labels": labels}, 0)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    outputs = reference(INPUT, output_router_logits=True)
    language = F.cross_entropy(outputs.logits.flatten(0, 1), labels.flatten())
    assert outputs.aux_loss > 0 and reference.config.router_aux_loss_coef == 0.01
    assert torch.allclose(trained, language + 0.01 * outputs.aux_loss, rtol=1e-6, atol=0)
    assert module.expert_load.last.sum(dim=-1).tolist() == [INPUT.numel() * 2] * 2  # top-2 of every token, per layer
    summary = module.summary()
    assert [sum(layer) for layer in summary["moe_tokens_per_expert"]] == [INPUT.numel() * 2] * 2


def test_load_imbalance_is_a_layers_largest_token_count_over_its_mean():
    counts = torch.tensor([[4.0, 4, 4, 4], [8, 0, 4, 4]])
    assert router.imbalance(counts).tolist() == [1.0, 2.0]


# --- 2 processes ---------------------------------------------------------------------------------------------------


class StarveExpert(pl.Callback):
    """On rank ``rank``, the router of every MoE layer never picks expert ``expert`` (its logit set to -inf)."""

    def __init__(self, rank: int = 1, expert: int = 0):
        self.rank, self.expert = rank, expert

    def on_fit_start(self, trainer, pl_module):
        if trainer.global_rank != self.rank:
            return
        for module in pl_module.model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.forward = self.starved(module)

    def starved(self, gate):
        def forward(hidden):
            logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            logits[:, self.expert] = float("-inf")
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top, indices = torch.topk(probs, gate.top_k, dim=-1)
            top = top / top.sum(dim=-1, keepdim=True) if gate.norm_topk_prob else top
            return logits, top.to(logits.dtype), indices
        return forward


def sharded_logits(rank: int, world: int, folders: list[Path]) -> list[torch.Tensor]:
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for folder in folders:
        module, _ = sharded_model(rank, world, mesh, pretrained_path=str(folder), param_dtype="float32")
        with torch.no_grad():
            out.append(module.model.eval()(INPUT).logits)
    return out


def every_distributed_check(rank: int, world: int, folders: list[Path], runs: list[list[str]]) -> list[torch.Tensor]:
    logits = sharded_logits(rank, world, folders)
    fit_in_process(rank, world, runs)
    return logits


def fit_of(folder: Path, run_folder: Path, *extra: str, devices: int = 2, batch_size: int = 2,
           callbacks: list[dict] | None = None) -> list[str]:
    return fit_arguments(run_folder, "--model.pretrained_path", str(folder), *extra, devices=devices,
                         batch_size=batch_size, steps=STEPS, callbacks=callbacks)


@pytest.fixture(scope="module")
def distributed(checkpoints, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_runs")
    uneven = write_moe_checkpoint(root / "three-experts", "qwen3_moe", "per_expert", num_experts=3)
    single = write_moe_checkpoint(root / "one-expert", "mixtral", "per_expert", num_local_experts=1,
                                  num_experts_per_tok=1)
    folders = [checkpoints["qwen3_moe", "per_expert"], checkpoints["mixtral", "fused"], uneven, single]
    # The auxiliary loss is a micro-batch's (transformers'): 1 and 2 processes compare without it.
    plain = ["--model.config_overrides", "{output_router_logits: false}"]
    qwen = checkpoints["qwen3_moe", "per_expert"]
    recorded = {"class_path": "callbacks.Results"}
    saved = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}
    runs = [fit_of(qwen, root / "two", *plain), fit_of(qwen, root / "aux", callbacks=[recorded, saved]),
            fit_of(qwen, root / "starved", callbacks=[recorded, {"class_path": f"{__name__}.StarveExpert"}]),
            # the config, then what FAST sets for a short run (a later --config would set them again)
            fit_arguments(root / "config", "--config", str(REPO / "configs" / "moe.yaml"), "--trainer.max_steps",
                          str(STEPS), "--data.batch_size", "2", "--trainer.limit_val_batches", "0",
                          "--trainer.log_every_n_steps", "1", callbacks=[recorded])]
    logits = run(every_distributed_check, root, folders, runs)
    # 1 process: the parity run, and a MoE trained on text with its tokenizer, for evaluate and generate
    corpus, valid = write_array(root / "wiki.json", articles()), write_lines(root / "valid.jsonl", articles(5)[2:])
    text = fit_arguments(
        root / "text", "--model.preset", "qwen3-moe-tiny", "--data", "lit_fsdp.data.wikipedia.WikipediaDataModule",
        "--data.train_path", str(corpus), "--data.val_path", str(valid), "--data.cache_dir", str(root / "cache"),
        "--data.vocab_size", "300", "--data.seq_len", "32", devices=1, batch_size=1, steps=8, callbacks=[saved])
    run(fit_in_process, root, [fit_of(qwen, root / "one", *plain, devices=1, batch_size=4), text], world=1)
    return {"root": root, "folders": folders, "logits": logits, "valid": valid}


def test_sharded_loads_give_from_pretrained_logits_with_experts_split_unevenly_or_fewer_than_ranks(distributed):
    for index, folder in enumerate(distributed["folders"]):
        want = reference_logits(folder)
        for rank_logits in distributed["logits"]:
            assert torch.allclose(rank_logits[index], want, rtol=1e-5, atol=1e-6), folder.name


def test_two_processes_give_one_process_losses(distributed):
    root = distributed["root"]
    one, two = (read_metrics(max((root / name).glob("lightning_logs/version_*/metrics.csv"))) for name in ("one", "two"))
    assert len(two["train/loss"]) == STEPS
    assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-4, abs=1e-5)
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-4, abs=1e-5)


def results(folder: Path) -> dict:
    return json.loads((folder / "results.jsonl").read_text().splitlines()[-1])


def test_the_auxiliary_loss_and_each_layers_imbalance_are_logged_and_tokens_per_expert_recorded(distributed):
    root = distributed["root"]
    metrics = read_metrics(max((root / "aux").glob("lightning_logs/version_*/metrics.csv")))
    assert len(metrics["train/aux_loss"]) == STEPS and all(value > 0 for value in metrics["train/aux_loss"])
    assert len(metrics["moe/imbalance_layer_1"]) == STEPS and all(v >= 1 for v in metrics["moe/imbalance_layer_1"])
    record = results(root / "aux")
    tokens = STEPS * 2 * 2 * 128 * 2  # steps x ranks x batch x seq_len x top-2
    assert [sum(layer) for layer in record["moe_tokens_per_expert"]] == [tokens, tokens]
    assert len(record["moe_imbalance"]) == 2
    plain = read_metrics(max((root / "two").glob("lightning_logs/version_*/metrics.csv")))
    assert metrics["train/loss"][0] == plain["train/loss"][0]  # the same first step: the LM loss is logged apart
    assert metrics["train/loss"][-1] != plain["train/loss"][-1]  # the auxiliary loss trained the router


def test_an_expert_starved_on_one_rank_does_not_hang_the_other(distributed):
    record = results(distributed["root"] / "starved")
    assert record["steps"] == STEPS and record["status"] == "ok"
    counts = record["moe_tokens_per_expert"]
    assert all(layer[0] < min(layer[1:]) for layer in counts)  # only rank 0's tokens reached expert 0


def test_the_export_has_the_sources_tensor_names_loads_whole_and_holds_the_trained_experts(distributed, tmp_path):
    source = distributed["folders"][0]
    out = export_hf(str(distributed["root"] / "aux" / "checkpoints" / "last.ckpt"), str(tmp_path / "export"))
    exported, original = load_file(str(out / "model.safetensors")), load_file(str(source / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    experts = [name for name in original if ".experts." in name]
    assert all(not torch.equal(exported[name], original[name]) for name in experts)  # every expert trained


def test_evaluate_and_generate_agree_on_a_moe_checkpoint_and_its_export(distributed, tmp_path):
    checkpoint = distributed["root"] / "text" / "checkpoints" / "last.ckpt"
    hf = export_hf(str(checkpoint), str(tmp_path / "hf"))
    data = EvaluationData(path=str(distributed["valid"]), cache_dir=str(distributed["root"] / "cache"))
    from_checkpoint, from_export = (evaluate(str(path), data, seq_len=16) for path in (checkpoint, hf))
    assert from_checkpoint["tokens"] == from_export["tokens"] > 0
    assert from_export["loss"] == pytest.approx(from_checkpoint["loss"], rel=1e-6)
    greedy = [continue_text(load_trained(str(path), device="cpu"), "Article 3", lambda _: None, max_new_tokens=12,
                            temperature=0).tolist() for path in (checkpoint, hf)]
    assert greedy[0] == greedy[1] and len(greedy[0]) == 12


def test_the_cpu_moe_config_trains_its_preset_with_the_router_loss(distributed):
    record = results(distributed["root"] / "config")
    assert record["model"] == "qwen3-moe-tiny" and record["steps"] == STEPS and record["status"] == "ok"
    metrics = read_metrics(max((distributed["root"] / "config").glob("lightning_logs/version_*/metrics.csv")))
    assert len(metrics["train/aux_loss"]) == STEPS
    assert len(record["moe_tokens_per_expert"]) == 2 and len(record["moe_tokens_per_expert"][0]) == 8


def test_token_ids_past_a_pretrained_models_vocabulary_are_refused_before_any_process_starts(checkpoints, tmp_path):
    result = cli_in_process("fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--model.pretrained_path",
                            str(checkpoints["mixtral", "fused"]), "--data.vocab_size", "600",
                            "--trainer.default_root_dir", str(tmp_path), cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if "vocabulary" in line]
    assert result.returncode != 0 and len(lines) == 1
    assert "token ids run to 599, past the model's vocabulary of 512" in lines[0]
