"""``--help`` tells every command and each command's own options, in plain text."""

from __future__ import annotations

import pytest

from lit_fsdp.commands.main import main

EVERY_COMMAND = ["fit", "validate", "export", "generate", "evaluate", "tune", "estimate", "hardware", "compressors"]


def help_of(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code in (0, None), capsys.readouterr().err[-2000:]
    return capsys.readouterr().out


def exits_quietly(capsys, *args: str) -> str:
    """The output of a command that returns normally or exits 0."""
    try:
        main(list(args))
    except SystemExit as done:
        assert done.code in (0, None), capsys.readouterr().err[-2000:]
    return capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_top_level_help_lists_every_command_with_a_description(capsys, flag):
    text = help_of(capsys, flag)
    listed = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and line.split()}
    for command in EVERY_COMMAND:
        assert command in listed and len(listed[command].split()) > 2, (command, text)
    assert "test" not in listed and "predict" not in listed  # not offered: the help says what to use instead


def test_an_unknown_command_names_every_command_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["trian"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(errors) == 1 and "unknown command 'trian'" in errors[0]
    assert all(command in errors[0] for command in EVERY_COMMAND), errors[0]


def test_estimate_help_is_its_own_and_points_to_fits_options(capsys):
    text = exits_quietly(capsys, "estimate", "--help")
    assert text.startswith("usage: lit_fsdp estimate") and "--tune.hardware" in text and "--json" in text
    assert "lit_fsdp fit --help" in text and "--trainer.max_steps" not in text and len(text.splitlines()) < 60


def test_compressors_help_is_usage_not_the_table_and_unknown_arguments_are_one_line(capsys):
    table = exits_quietly(capsys, "compressors")
    text = exits_quietly(capsys, "compressors", "--help")
    assert text.startswith("usage: lit_fsdp compressors") and text != table and "topk" not in text
    with pytest.raises(SystemExit) as exit_info:
        main(["compressors", "--bogus"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(errors) == 1 and "--bogus" in errors[0], errors


@pytest.mark.parametrize("command", [
    "fit", "validate", "export", "hardware", "estimate", "generate", "evaluate",
    "fit --trainer.strategy.help offload.SlideFSDPStrategy", "fit --data.help lit_fsdp.data.wikipedia.WikipediaDataModule",
    "tune",
])
def test_help_shows_no_rst_literal_markers(capsys, command):
    text = exits_quietly(capsys, *command.split(), *([] if ".help" in command else ["--help"]))
    assert "usage:" in text and "``" not in text, [line for line in text.splitlines() if "``" in line][:5]
