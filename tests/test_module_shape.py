"""The code's shape: no module over 500 lines, and no comment or docstring that names an issue of this project.

A module past 500 lines holds two concerns; an issue number in a comment points at history the reader cannot see,
where the comment should say what the code does and why. An upstream bug is still named as ``owner/repo#N``, which
these checks let through. Files are read, never imported: ``tokenize`` finds the ``#`` comments, ``ast`` the docstrings
and other string statements.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE = ("lit_fsdp", "offload", "compress", "callbacks", "scripts")
MAX_LINES = 500
ISSUE = re.compile(r"\bissues? [0-9]+", re.IGNORECASE)


def modules(*folders: str, root: Path = REPO) -> list[Path]:
    return sorted(p for folder in folders for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts)


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def issue_lines_in_python(path: Path) -> list[int]:
    """Lines of ``path`` whose ``#`` comment, docstring or other string statement names an issue number."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT and ISSUE.search(token.string)}
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.update(number for number in range(node.lineno, node.end_lineno + 1) if ISSUE.search(lines[number - 1]))
    return sorted(found)


def issue_lines_in_shell(path: Path) -> list[int]:
    """Lines of a shell script that are comments naming an issue number."""
    return [number for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if line.lstrip().startswith("#") and ISSUE.search(line)]


def issue_mentions(root: Path = REPO) -> list[str]:
    """``file:line`` of every issue number in the comments of the code, the tests and CI's script."""
    places = [f"{p.relative_to(root)}:{n}" for p in modules(*CODE, "tests", root=root) for n in issue_lines_in_python(p)]
    ci = root / ".ci" / "run"
    if ci.exists():
        places += [f"{ci.relative_to(root)}:{n}" for n in issue_lines_in_shell(ci)]
    return places


def test_every_module_is_at_most_500_lines():
    long = [f"{p.relative_to(REPO)} ({n} lines)" for p in modules(*CODE) if (n := line_count(p)) > MAX_LINES]
    assert not long, (f"modules over {MAX_LINES} lines: {', '.join(long)}; split each by concern into modules of at most "
                      f"{MAX_LINES} lines")


def test_no_comment_or_docstring_names_an_issue_of_this_project():
    places = issue_mentions()
    assert not places, (f"comments naming an issue number: {', '.join(places)}; say what the code does and why instead "
                        "(an upstream bug as owner/repo#N)")


def test_the_checks_flag_a_long_module_and_issue_numbers_in_comments_docstrings_and_ci_but_not_upstream_bugs(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "scripts" / "limit.py").write_text("x = 1\n" * MAX_LINES)
    assert [line_count(p) > MAX_LINES for p in modules("scripts", root=tmp_path)] == [False, True]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        '"""What it pins (Issue 7)."""\n'
        "x = 1  # see issues 27 and 37\n"
        "y = 2  # works around pytorch/pytorch#12345\n"
        'message = "issue 5 is not a comment"\n'
        "def f():\n"
        '    """Line one.\n\n    issue 12: on the third line of the docstring."""\n'
    )
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text('#!/bin/sh\n# The floor (issue 17): why\necho "issue 3"\n')
    assert issue_mentions(tmp_path) == ["tests/test_x.py:1", "tests/test_x.py:2", "tests/test_x.py:8", ".ci/run:2"]
