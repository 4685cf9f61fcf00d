"""Help text as a terminal shows it: the RST literal markers (double backticks) of docstrings dropped."""

from __future__ import annotations

from argparse import Action

from jsonargparse import DefaultHelpFormatter


def plain(text: str) -> str:
    """``text`` without the double backticks that mark literals in RST docstrings."""
    return text.replace("``", "")


class PlainHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter over plain text: options' help and group descriptions come from docstrings."""

    def _expand_help(self, action: Action) -> str:
        return plain(super()._expand_help(action))

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def start_section(self, heading: str | None) -> None:  # a group's heading: a class docstring's first line
        super().start_section(plain(heading) if heading else heading)
