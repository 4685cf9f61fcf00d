"""A misspelt key in a config file or an option is named, with its file and the nearest valid key, every one at once,
in a short block instead of jsonargparse's usage and its first error (``lit_fsdp.commands.config_keys``)."""

from __future__ import annotations

import pytest

from lit_fsdp.commands.main import main
from tests.helpers import REPO

QUICKSTART = REPO / "configs" / "quickstart.yaml"


def refused(capsys, *args: str) -> str:
    """What ``python -m lit_fsdp fit ARGS`` prints on stderr, checked to end with status 2 before anything runs."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_every_misspelt_key_of_a_config_is_named_with_its_file_and_the_nearest_key(tmp_path, capsys):
    typos = tmp_path / "typos.yaml"
    typos.write_text("model:\n  lerning_rate: 1.0e-3\n  warmup_step: 3\ntrainer:\n  max_step: 3\n"
                     "  strategy:\n    class_path: offload.SlideFSDPStrategy\n    init_args:\n      windw: 2\n")
    err = refused(capsys, "--config", str(QUICKSTART), "--config", str(typos))
    assert err.splitlines() == [
        "lit_fsdp: error: 4 unknown keys (python -m lit_fsdp fit --help lists the options):",
        f"  in {typos}:",
        "    model.lerning_rate: did you mean model.learning_rate?",
        "    model.warmup_step: did you mean model.warmup_steps?",
        "    trainer.max_step: did you mean trainer.max_steps?",
        "    trainer.strategy.init_args.windw: did you mean trainer.strategy.init_args.window? "
        "(of offload.strategy.SlideFSDPStrategy)",
    ], err


def test_a_misspelt_option_is_named_with_the_nearest_one(capsys):
    err = refused(capsys, "--config", str(QUICKSTART), "--trainer.strategy", "offload.SlideFSDPStrategy",
                  "--trainer.strategy.init_args.windw", "2", "--model.lerning_rate", "3")
    assert err.splitlines()[1:] == [
        "  in the command line:",
        "    --trainer.strategy.init_args.windw: did you mean --trainer.strategy.init_args.window? "
        "(of offload.strategy.SlideFSDPStrategy)",
        "    --model.lerning_rate: did you mean --model.learning_rate?",
    ], err


def test_a_value_jsonargparse_refuses_is_one_line_naming_the_option_and_no_usage(capsys):
    err = refused(capsys, "--config", str(QUICKSTART), "--model.learning_rate", "fast")
    assert err.strip().splitlines() == [
        "lit_fsdp: error: --model.learning_rate: Expected a <class 'float'>. Got value: fast; python -m lit_fsdp fit "
        "--help lists the options (LIT_FSDP_TRACEBACK=1 shows the traceback)"], err


def test_help_names_python_m_lit_fsdp_not_main_py(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m lit_fsdp [options] fit") and "__main__" not in out, out[:300]


@pytest.mark.parametrize(("option", "value", "line"), [
    ("--trainer.strategy.init_args.sharding", "FULL_SHRD",
     "--trainer.strategy.init_args.sharding FULL_SHRD: did you mean FULL_SHARD? (choices: FULL_SHARD, SHARD_GRAD_OP, "
     "NO_SHARD, HYBRID_SHARD) (of lit_fsdp.strategy.FSDP2Strategy)"),
    ("--trainer.strategy.init_args.compression", "{method: int8, num_bit: 4}",
     "--trainer.strategy.init_args.compression.num_bit: did you mean "
     "--trainer.strategy.init_args.compression.num_bits? (of compress.config.CompressionConfig)"),
], ids=["sharding-value", "compression-key"])
def test_a_misspelt_strategy_value_or_compression_key_is_one_line_with_the_nearest(capsys, option, value, line):
    """Inside the strategy's arguments jsonargparse's own error is "Does not validate against any of the Union
    subtypes", naming neither the key nor the value."""
    err = refused(capsys, "--config", str(QUICKSTART), option, value)
    assert err.strip().splitlines() == [f"lit_fsdp: error: {line}; python -m lit_fsdp fit --help lists the options "
                                        "(LIT_FSDP_TRACEBACK=1 shows the traceback)"], err


def test_a_value_outside_its_choices_in_a_config_is_named_with_the_keys(tmp_path, capsys):
    typos = tmp_path / "typos.yaml"
    typos.write_text("trainer:\n  strategy:\n    class_path: offload.SlideFSDPStrategy\n    init_args:\n"
                     "      update: forwrd\n      grad_sync: nccl\n      windw: 2\n")
    err = refused(capsys, "--config", str(QUICKSTART), "--config", str(typos))
    slide = "(of offload.strategy.SlideFSDPStrategy)"
    assert err.splitlines() == [
        "lit_fsdp: error: 1 unknown key and 2 unknown values (python -m lit_fsdp fit --help lists the options):",
        f"  in {typos}:",
        "    trainer.strategy.init_args.update forwrd: did you mean forward? (choices: auto, synchronous, forward, "
        f"split, speculative, delayed) {slide}",
        f"    trainer.strategy.init_args.grad_sync nccl: not one of gpu_reduce, cpu_reduce {slide}",
        f"    trainer.strategy.init_args.windw: did you mean trainer.strategy.init_args.window? {slide}",
    ], err
