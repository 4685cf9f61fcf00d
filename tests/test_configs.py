"""Every shipped config parses against the real CLI, alone and composed, and ends with the callbacks it should: the
CLI's standard list (``lit_fsdp.commands.cli.CALLBACKS``), which no config repeats (under SlideFSDP the CLI adds
OffloadStats itself); a list replaces it, ``+=`` adds."""

from __future__ import annotations

import json

import pytest
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from callbacks import CommProfiler, OffloadStats, Results
from callbacks import ModelCheckpoint as StandardCheckpoint
from lit_fsdp.commands.cli import CALLBACKS, run
from tests.helpers import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
QUICKSTART = REPO / "configs" / "quickstart.yaml"
WIKIPEDIA = REPO / "configs" / "wikipedia.yaml"
INT8 = REPO / "configs" / "int8.yaml"
STANDARD = [callback["class_path"] for callback in CALLBACKS]


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
        assert callback_classes(result) == STANDARD, shown
        assert result["comm_profiler"] is mine.get("comm_profiler", False), shown
    for key, value in (mine.get("model") or {}).items():  # the later file wins (a dict's unset fields are defaults)
        got = resolved[1]["model"][key]
        assert value.items() <= got.items() if isinstance(value, dict) else got == value, key


def test_the_method_configs_and_offload_turn_the_comm_profiler_on():
    profiled = {config.name for config in CONFIGS if yaml.safe_load(config.read_text()).get("comm_profiler")}
    methods = {config.name for config in CONFIGS if "compression:" in config.read_text()}
    assert methods and profiled == methods | {"offload.yaml"}


def lists_in(node, key: str = "") -> list[tuple[str, list]]:
    """Every list in a config's YAML, at any depth, with its key (``trainer.callbacks``)."""
    if isinstance(node, dict):
        return [found for name, value in node.items() for found in lists_in(value, f"{key}.{name}".lstrip("."))]
    if isinstance(node, list):
        return [(key, node)] + [found for index, item in enumerate(node) for found in lists_in(item, f"{key}[{index}]")]
    return []


def test_no_config_repeats_a_list_of_another_or_lists_callbacks():
    """A list said in two configs has to be kept in step in both: say it once (the standard callbacks are the CLI's
    CALLBACKS; SlideFSDP's OffloadStats the CLI adds; ``enable_checkpointing: false`` drops the ModelCheckpoint)."""
    first: dict[str, str] = {}
    for config in CONFIGS:
        for key, value in lists_in(yaml.safe_load(config.read_text())):
            assert not key.startswith("trainer.callbacks"), f"{config.name}: {key} lists callbacks; drop the list"
            shown = json.dumps(value, sort_keys=True)
            assert shown not in first, f"{config.name}: {key} repeats the list of {first[shown]}"
            first[shown] = f"{config.name}'s {key}"


@pytest.mark.parametrize("config", ["offload.yaml", "sft_8b_full_offload.yaml"], ids=["standard", "checkpointing-off"])
def test_the_cli_gives_a_slidefsdp_run_one_offload_stats_before_results(tmp_path, config):
    """Two of the SlideFSDP configs (the others' synthetic data of a 128k or 152k vocabulary takes 9 s to build):
    OffloadStats before Results, which records the others' summaries; a listed OffloadStats is the one kept."""
    config = REPO / "configs" / config
    offline = ("--trainer.accelerator", "cpu", "--model.pretrained_path", "null")  # the preset's shape, on meta
    callbacks = trainer_callbacks(tmp_path, "--config", str(QUICKSTART), "--config", str(config), *offline)
    kinds = [type(c) for c in callbacks]
    assert kinds.count(OffloadStats) == 1 and kinds.index(OffloadStats) < kinds.index(Results), kinds
    checkpointing = yaml.safe_load(config.read_text())["trainer"].get("enable_checkpointing", True)
    assert any(isinstance(c, ModelCheckpoint) for c in callbacks) is checkpointing, kinds
    own = "[{class_path: callbacks.OffloadStats, init_args: {warmup_steps: 5}}]"
    listed = trainer_callbacks(tmp_path, "--config", str(QUICKSTART), "--config", str(config), *offline,
                               "--trainer.callbacks", own)
    assert [c.warmup_steps for c in listed if isinstance(c, OffloadStats)] == [5]  # the listed one, not a second
    fsdp2 = trainer_callbacks(tmp_path, "--config", str(QUICKSTART))
    assert not any(isinstance(c, OffloadStats) for c in fsdp2)


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
