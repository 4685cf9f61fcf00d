"""README.md and docs/*.md name real things: links resolve, repository paths exist, commands and configs are real.

A file renamed or moved, a heading reworded, a command dropped: each breaks a page a user follows, and each fails
here. The checker reads links outside code, and repository paths and commands inside code (inline spans and
fenced blocks), where the pages name them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lit_fsdp.commands.main import COMMANDS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 200
#: The pages the README must link: one per feature, and the ones a newcomer needs.
DOCS_PAGES = ("architecture", "benchmarks", "compression", "estimate", "faults", "gpu", "offload", "tuning")

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
#: A repository path: a top-level folder of this repository, then anything a path holds.
TOP_FOLDERS = r"(?:\.ci|callbacks|compress|configs|docs|lit_fsdp|offload|scripts|tests)"
PATH = re.compile(rf"(?<![\w./-])({TOP_FOLDERS}/[\w.*/<>{{}}-]*)")
#: A path is checked when it names a file (an extension) or a folder (a trailing slash): ``compress/nonfinite`` and
#: ``offload/*`` without one are metric names.
CHECKED_PATH = re.compile(r"(\.[A-Za-z]\w*|/)$")
DOTTED = re.compile(r"(?<![\w./-])((?:callbacks|compress|lit_fsdp|offload)(?:\.[A-Za-z_]\w*)+)")
COMMAND = re.compile(r"-m lit_fsdp\s+([^\s`|)\\]+)")
CONFIG = re.compile(r"--config[= ]+([^\s`|)\\]+)")


def pages() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside code: fenced blocks and inline spans blanked."""
    text = FENCE.sub("", text)
    return INLINE_CODE.sub("``", text)


def code(text: str) -> list[str]:
    """Every fenced block and inline code span, in order."""
    blocks = [match.group(0) for match in FENCE.finditer(text)]
    return blocks + [match.group(2) for match in INLINE_CODE.finditer(FENCE.sub("", text))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors as its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings, with GitHub's -1, -2 suffixes for repeated ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in HEADING.finditer(FENCE.sub("", text)):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problems(text: str, page: Path) -> list[str]:
    """Relative links whose file or heading does not exist (web links are not followed)."""
    problems = []
    for target in LINK.findall(prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"link {target}: {resolved} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            problems.append(f"link {target}: {resolved.name} has no heading with anchor #{anchor}")
    return problems


def module_file(parts: list[str], root: Path) -> Path | None:
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def path_problems(text: str, root: Path = REPO) -> list[str]:
    """Repository paths named in code that do not exist, and dotted names whose module or attribute does not."""
    problems = []
    for snippet in code(text):
        for raw in PATH.findall(snippet):
            name = raw.split("::")[0].rstrip(".,;:")  # tests/test_x.py::test_y names the file
            if "<" in name or "{" in name or not CHECKED_PATH.search(name):
                continue
            exists = any(root.glob(name)) if "*" in name else (root / name).exists()
            if not exists:
                problems.append(f"path {name} does not exist")
        for dotted in DOTTED.findall(snippet):
            parts = dotted.split(".")
            # the longest prefix that is a module; the name after it must be defined or imported there
            for end in range(len(parts), 0, -1):
                module = module_file(parts[:end], root)
                if module is not None:
                    break
            else:
                problems.append(f"name {dotted}: no module {parts[0]}")
                continue
            rest = parts[end:]
            if rest and not re.search(rf"\b{re.escape(rest[0])}\b", module.read_text()):
                problems.append(f"name {dotted}: {module.relative_to(root)} has no {rest[0]}")
    return problems


def command_problems(text: str) -> list[str]:
    """``python -m lit_fsdp X`` where X is neither a command nor an option (``COMMAND`` in capitals stands for any)."""
    named = [name for name in COMMAND.findall(text) if not name.startswith("-") and not name.isupper()]
    return [f"python -m lit_fsdp {name}: not a command of lit_fsdp.commands.main.COMMANDS"
            for name in named if name not in COMMANDS]


def config_problems(text: str, root: Path = REPO) -> list[str]:
    """``--config configs/X.yaml`` where the file does not exist (run folders' own files, like best.yaml, are not
    configs/ paths and are left alone)."""
    return [f"--config {name}: no such file" for name in CONFIG.findall(text)
            if name.startswith("configs/") and "<" not in name and not (root / name).is_file()]


def problems(page: Path) -> list[str]:
    text = page.read_text()
    found = link_problems(text, page) + path_problems(text) + command_problems(text) + config_problems(text)
    return [f"{page.relative_to(REPO)}: {problem}" for problem in found]


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_every_link_path_command_and_config_a_page_names_exists(page):
    assert not problems(page), "\n".join(problems(page))


def test_the_checker_catches_a_renamed_file_a_broken_link_a_lost_heading_and_a_dropped_command():
    page = REPO / "docs" / "example.md"  # never written: its text is checked as if it were there
    good = ("See [the check](gpu.md#running-the-check) and `scripts/gpu_check.py`; `offload/strategy.py` and\n"
            "`lit_fsdp.strategy.FSDP2Strategy`; metrics like `compress/nonfinite` are not paths.\n\n"
            "```bash\npython -m lit_fsdp fit --config configs/quickstart.yaml\n```\n")
    assert link_problems(good, page) == []
    assert path_problems(good) == []
    assert command_problems(good) == [] and config_problems(good) == []
    bad = ("See [the check](gpu_check.md), [a heading](gpu.md#no-such-heading) and [home](../README.md#nowhere);\n"
           "run `scripts/gpu_checks.py`, read `compress/onebit_adam_old.py` and `lit_fsdp.strategy.FSDP3Strategy`.\n\n"
           "```bash\npython -m lit_fsdp train --config configs/quick.yaml\n```\n")
    links = link_problems(bad, page)
    assert [problem.split(":")[0] for problem in links] == [
        "link gpu_check.md", "link gpu.md#no-such-heading", "link ../README.md#nowhere"]
    assert "gpu_check.md does not exist" in links[0] and "no heading with anchor #no-such-heading" in links[1]
    assert sorted(path_problems(bad)) == [
        "name lit_fsdp.strategy.FSDP3Strategy: lit_fsdp/strategy.py has no FSDP3Strategy",
        "path compress/onebit_adam_old.py does not exist",
        "path configs/quick.yaml does not exist",
        "path scripts/gpu_checks.py does not exist",
    ]
    assert command_problems(bad) == ["python -m lit_fsdp train: not a command of lit_fsdp.commands.main.COMMANDS"]
    assert config_problems(bad) == ["--config configs/quick.yaml: no such file"]


def test_anchors_follow_githubs_rule_for_markup_punctuation_and_repeats():
    text = "# Offload: models (`offload.SlideFSDPStrategy`)\n## Measured\n## Measured\n```\n# not a heading\n```\n"
    assert anchors(text) == {"offload-models-offloadslidefsdpstrategy", "measured", "measured-1"}


def test_the_readme_is_at_most_200_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to a page in docs/"


def test_the_readme_links_every_docs_page():
    targets = LINK.findall(prose(README.read_text()))
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in targets}
    wanted = {REPO / "docs" / f"{name}.md" for name in DOCS_PAGES} | set((REPO / "docs").glob("*.md"))
    missing = sorted(str(path.relative_to(REPO)) for path in wanted if path.resolve() not in linked)
    assert not missing, f"README.md does not link {missing}"


def test_the_docs_index_lists_every_docs_page_once():
    index = (REPO / "docs" / "README.md").read_text()
    listed = re.findall(r"^- \[([\w.-]+\.md)\]\(\1\): \S", index, re.M)
    pages = sorted(page.name for page in (REPO / "docs").glob("*.md") if page.name != "README.md")
    assert sorted(listed) == pages, f"docs/README.md lists {sorted(listed)}; docs/ holds {pages}"


def test_every_docs_page_opens_with_a_title_and_a_paragraph_saying_what_it_covers():
    for page in sorted((REPO / "docs").glob("*.md")):
        blocks = [block.strip() for block in page.read_text().split("\n\n") if block.strip()]
        assert blocks[0].startswith("# ") and "\n" not in blocks[0], f"{page.name}: no title on its first line"
        assert not blocks[1].startswith(("#", "|", "```", "- ")), f"{page.name}: no opening paragraph"


def test_the_readme_shows_the_setup_and_test_command_ci_runs():
    """``.ci/run`` runs "the README's test command": the README must show the same install and pytest lines."""
    readme = README.read_text()
    ci = (REPO / ".ci" / "run").read_text()
    torch_pin = re.search(r"(?:pip install -q|ensure_env main python3) (torch==[^\s\"]+)", ci).group(1)
    # CI's main suite is the README's command with its slowest items listed (--durations)
    pytest_line = "python -m " + re.search(r'"\$MAIN/bin/python" -m (pytest .*?)(?: --durations=\d+)?$', ci, re.M).group(1)
    # the README's pip reads PyTorch's CPU index (the public index's torch is the CUDA build); CI's pip, with a local
    # wheel, installs the same pin
    assert re.search(rf"pip install {re.escape(torch_pin)}( --index-url https://download\.pytorch\.org/whl/cpu)? "
                     r"&& pip install -e \"\.\[test\]\"", readme)
    assert pytest_line in readme


#: A GPU figure in a table row: a percentage with a decimal (MFU, a share, an error), or a number in a tokens/s column.
GPU_FIGURE = re.compile(r"\d\.\d+%")
RECORD = re.compile(r"gpu_runs/[\w./-]*[\w-]")


def gpu_sections() -> dict[str, str]:
    """The text whose tables hold GPU figures: docs/gpu.md whole, and the README's "Measured on a GPU" section."""
    readme = README.read_text()
    section = readme[readme.index("## Measured on a GPU"):]
    return {"docs/gpu.md": (REPO / "docs" / "gpu.md").read_text(), "README.md": section[:section.find("\n## ", 3)]}


def unrecorded_figure_rows(text: str, docs: Path = REPO / "docs") -> list[str]:
    """Table rows with a GPU figure that name no file existing under ``docs/gpu_runs/`` (``gpu_runs/...``, in a link
    or code span)."""
    problems, tokens_column = [], None
    for line in FENCE.sub("", text).splitlines():
        if not line.startswith("|"):
            tokens_column = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if tokens_column is None:  # a table's first line: its header
            tokens_column = next((i for i, cell in enumerate(cells) if "tokens/s" in cell), -1)
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        figure = GPU_FIGURE.search(line) or (0 <= tokens_column < len(cells) and re.search(r"\d", cells[tokens_column]))
        if figure and not any((docs / path).is_file() for path in RECORD.findall(line)):
            problems.append(line[:100])
    return problems


@pytest.mark.parametrize("page", sorted(gpu_sections()))
def test_every_gpu_figure_row_names_a_record_file_under_docs_gpu_runs(page):
    problems = unrecorded_figure_rows(gpu_sections()[page])
    assert not problems, f"{page}: rows with a GPU figure and no record in docs/gpu_runs/:\n" + "\n".join(problems)


def test_the_record_checker_flags_figure_rows_without_an_existing_record():
    text = ("| run | tokens/s | MFU | record |\n|---|---|---|---|\n"
            "| a | 30,402 | 25.3% | [`w1`](gpu_runs/2026-11-26-h200/window1_summary.json) |\n"
            "| b | 55,408 | | none |\n"
            "| c | | 46.0% | `docs/gpu_runs/2026-11-26-h200/window9_summary.json` |\n"
            "| d | | | not a figure: within 10% |\n\n"
            "| codec | GB/s |\n|---|---|\n| topk (1%) | 150 |\n")
    assert [row.split("|")[1].strip() for row in unrecorded_figure_rows(text)] == ["b", "c"]


def test_the_usage_config_table_lists_every_shipped_config():
    """docs/usage.md's table of configs names each file of configs/: in a row of its own, or by its name in the
    ``configs/<method>.yaml`` row of the compression methods."""
    text = (REPO / "docs" / "usage.md").read_text()
    section = text[text.index("## Configs"):]
    rows = [line for line in section[:section.index("\n## ", 3)].splitlines() if line.startswith("| `configs/")]
    own = {re.match(r"\| `configs/([\w-]+)\.yaml`", row).group(1) for row in rows if "<method>" not in row}
    methods = set(re.findall(r"`(\w+)`", next(row for row in rows if "<method>" in row)))
    shipped = {path.stem for path in (REPO / "configs").glob("*.yaml")}
    assert not shipped - own - methods, f"docs/usage.md's config table leaves out {sorted(shipped - own - methods)}"
    assert not (own | methods) - shipped, f"docs/usage.md's config table names {sorted((own | methods) - shipped)}"
