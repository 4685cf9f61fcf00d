"""Every shipped config parses against the real CLI, alone and composed, and ends with the callbacks it should: the
CLI's standard list (``lit_fsdp.commands.cli.CALLBACKS``), which no config repeats; a list replaces it, ``+=`` adds."""

from __future__ import annotations

import json

import pytest
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from callbacks import CommProfiler
from callbacks import ModelCheckpoint as StandardCheckpoint
from lit_fsdp.commands.cli import CALLBACKS, run
from tests.helpers import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
QUICKSTART = REPO / "configs" / "quickstart.yaml"
WIKIPEDIA = REPO / "configs" / "wikipedia.yaml"
INT8 = REPO / "configs" / "int8.yaml"
STANDARD = [callback["class_path"] for callback in CALLBACKS]
#: The configs whose callbacks are not the standard list, and what they resolve to (each says why in a comment).
OWN = {
    # checkpointing off: one checkpoint of the 8B is 96 GB
    "llama_8b_offload.yaml": ["callbacks.Throughput", "callbacks.Memory", "callbacks.CompressionStats",
                              "callbacks.Quality", "callbacks.OffloadStats", "callbacks.Results"],
    "offload.yaml": [*STANDARD, "callbacks.OffloadStats"],  # appended: SlideFSDP's host-device traffic and CPU update
    "qwen_32b_lora.yaml": [*STANDARD, "callbacks.OffloadStats"],
    # checkpointing off: one checkpoint of the 14B is 84 GiB
    "qwen_14b_full.yaml": ["callbacks.Throughput", "callbacks.Memory", "callbacks.Quality", "callbacks.OffloadStats",
                           "callbacks.Results"],
    # the fine-tuning recipes: the 8B's and the 14B's full checkpoints (61 and 84 GiB) off, the LoRA one's kept (MB)
    "sft_8b_full_offload.yaml": ["callbacks.Throughput", "callbacks.Memory", "callbacks.Quality",
                                 "callbacks.OffloadStats", "callbacks.Results"],
    "sft_14b_full_offload.yaml": ["callbacks.Throughput", "callbacks.Memory", "callbacks.Quality",
                                  "callbacks.OffloadStats", "callbacks.Results"],
    "sft_8b_lora_offload.yaml": [*STANDARD, "callbacks.OffloadStats"],
}


def print_config(capsys, *configs, args: tuple[str, ...] = ()) -> dict:
    argv = ["fit"] + [arg for config in configs for arg in ("--config", str(config))] + [*args, "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        run(argv)
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def callback_classes(config: dict) -> list[str]:
    callbacks = config["trainer"]["callbacks"] or []
    return [callback["class_path"] for callback in (callbacks if isinstance(callbacks, list) else [callbacks])]


def trainer_callbacks(tmp_path, *args: str) -> list:
    """The callbacks of the Trainer the CLI builds from ``args`` (nothing is trained)."""
    cli = run(["--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path), *args], run=False)
    return cli.trainer.callbacks


def measuring(callbacks: list) -> list[str]:
    """The callbacks of ``callbacks/`` among ``callbacks``, as ``callbacks.Name``, in order."""
    return [f"callbacks.{type(c).__name__}" for c in callbacks if f"callbacks.{type(c).__name__}" in STANDARD]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses_alone_and_composed_and_ends_with_its_callbacks(capsys, config):
    mine = yaml.safe_load(config.read_text())
    compositions = [[config], [QUICKSTART, config]] + ([[WIKIPEDIA, config]] if config != WIKIPEDIA else [])
    resolved = [print_config(capsys, *configs) for configs in compositions]
    strategy = (mine.get("trainer") or {}).get("strategy", {}).get("class_path", "FSDP2Strategy").split(".")[-1]
    for configs, result in zip(compositions, resolved):
        shown = " ".join(path.name for path in configs)
        # the config's strategy, or FSDP2 by default, wins over the earlier config's
        assert result["trainer"]["strategy"]["class_path"].split(".")[-1] == strategy, shown
        assert callback_classes(result) == OWN.get(config.name, STANDARD), shown
        assert result["comm_profiler"] is mine.get("comm_profiler", False), shown
    for key, value in (mine.get("model") or {}).items():  # the later file wins (a dict's unset fields are defaults)
        got = resolved[1]["model"][key]
        assert value.items() <= got.items() if isinstance(value, dict) else got == value, key


def test_the_method_configs_and_offload_turn_the_comm_profiler_on_and_nothing_else_repeats_a_list():
    profiled = {config.name for config in CONFIGS if yaml.safe_load(config.read_text()).get("comm_profiler")}
    methods = {config.name for config in CONFIGS if "compression:" in config.read_text()}
    assert methods and profiled == methods | {"offload.yaml"}
    for config in CONFIGS:
        trainer = yaml.safe_load(config.read_text()).get("trainer") or {}
        listed = [callback["class_path"] for callback in trainer.get("callbacks", [])]
        added = [callback["class_path"] for callback in trainer.get("callbacks+", [])]
        assert sorted(listed) != sorted(STANDARD) and not set(added) & set(STANDARD), config.name
        assert bool(listed or added) is (config.name in OWN), f"{config.name}: drop the list, or add it to OWN with why"


def test_the_quickstart_resolves_to_synthetic_data_on_two_cpu_processes(capsys):
    config = print_config(capsys, QUICKSTART)
    assert config["data"]["class_path"] == "lit_fsdp.data.synthetic.SyntheticDataModule"
    assert (config["trainer"]["accelerator"], config["trainer"]["devices"]) == ("cpu", 2)


@pytest.mark.parametrize("configs", [[], [QUICKSTART], [QUICKSTART, INT8]], ids=["none", "quickstart", "int8"])
def test_a_config_of_its_own_list_replaces_the_standard_one(capsys, tmp_path, configs):
    own = tmp_path / "own.yaml"
    own.write_text(json.dumps({"trainer": {"callbacks": [{"class_path": "callbacks.HostSyncs"}]}}))
    assert callback_classes(print_config(capsys, *configs, own)) == ["callbacks.HostSyncs"]
    empty = tmp_path / "empty.yaml"
    empty.write_text("trainer:\n  callbacks: []\n")
    assert callback_classes(print_config(capsys, *configs, empty)) == []
    assert callback_classes(print_config(capsys, *configs, args=("--trainer.callbacks", "[]"))) == []


def test_plus_appends_to_the_standard_list_from_the_command_line_and_from_a_config(capsys, tmp_path):
    appended = print_config(capsys, INT8, args=("--trainer.callbacks+=callbacks.HostSyncs",))
    assert callback_classes(appended) == [*STANDARD, "callbacks.HostSyncs"]
    plus = tmp_path / "plus.yaml"
    plus.write_text("trainer:\n  callbacks+:\n    - class_path: callbacks.HostSyncs\n")
    assert callback_classes(print_config(capsys, QUICKSTART, plus)) == [*STANDARD, "callbacks.HostSyncs"]


def test_comm_profiler_adds_one_comm_profiler_unless_the_callbacks_list_one(tmp_path):
    def profilers(*args: str) -> list[CommProfiler]:
        return [c for c in trainer_callbacks(tmp_path, "--config", str(INT8), *args) if isinstance(c, CommProfiler)]

    assert len(profilers()) == 1  # int8.yaml's comm_profiler: true
    assert profilers("--comm_profiler", "false") == []
    (listed,) = profilers("--trainer.callbacks+=callbacks.CommProfiler", "--trainer.callbacks.wait=1")
    assert listed.wait == 1  # the listed one, not a second
    quickstart = trainer_callbacks(tmp_path, "--config", str(QUICKSTART))
    assert not any(isinstance(c, CommProfiler) for c in quickstart)  # off by default


def test_the_trainer_gets_the_standard_callbacks_and_one_progress_bar(tmp_path):
    callbacks = trainer_callbacks(tmp_path, "--config", str(QUICKSTART))
    assert measuring(callbacks) == [*STANDARD[1:], STANDARD[0]]  # Lightning puts the ModelCheckpoint last
    (checkpoint,) = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    assert type(checkpoint) is StandardCheckpoint and checkpoint.save_last and checkpoint._every_n_train_steps == 100
    assert sum(isinstance(c, ProgressBar) for c in callbacks) == 1
    quiet = trainer_callbacks(tmp_path, "--config", str(QUICKSTART), "--trainer.enable_progress_bar", "false")
    assert not any(isinstance(c, ProgressBar) for c in quiet)


def test_checkpointing_off_leaves_the_standard_checkpoint_out_but_refuses_a_listed_one(tmp_path):
    off = ["--config", str(QUICKSTART), "--trainer.enable_checkpointing", "false"]
    callbacks = trainer_callbacks(tmp_path, *off)
    assert not any(isinstance(c, ModelCheckpoint) for c in callbacks)
    assert measuring(callbacks) == STANDARD[1:]
    listed = "[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {save_top_k: 0}}]"
    with pytest.raises(MisconfigurationException, match="enable_checkpointing=False"):
        trainer_callbacks(tmp_path, *off, "--trainer.callbacks", listed)


@pytest.mark.parametrize(("args", "reduce_dtype"), [
    (["--config", str(QUICKSTART), "--config", str(REPO / "configs" / "offload.yaml")], "auto"),
    (["--trainer.strategy.class_path", "offload.SlideFSDPStrategy"], "auto"),
    (["--config", str(QUICKSTART)], "float32"),
    (["--trainer.strategy.class_path", "offload.SlideFSDPStrategy", "--trainer.strategy.init_args.reduce_dtype",
      "float32"], "float32"),
], ids=["offload_on_quickstart", "slide_flag", "fsdp2", "slide_given"])
def test_a_strategy_chosen_over_fsdp2_gets_its_own_reduce_dtype_default_not_fsdp2s(tmp_path, args, reduce_dtype):
    """The CLI keeps the arguments two strategies share when a config or flag changes the class_path: SlideFSDP chosen
    over the default FSDP2 reduces in its own default (auto), not in FSDP2's float32; a value given stays."""
    cli = run(["--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path), *args], run=False)
    assert cli.trainer.strategy.reduce_dtype == reduce_dtype
