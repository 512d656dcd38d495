"""kdbench.docgen: the docs' generated blocks are deterministic, --check catches drift from the code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kdbench import docgen
from kdbench.config.suite_times import suite_times
from kdbench.docgen.cell_keys import cell_keys
from kdbench.docgen.cli_reference import cli_parser, subparsers
from kdbench.docgen.tables import registered_methods
from tests.support.paths import ROOT

NAMES = list(docgen.BLOCKS)


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    """Every block generated once from the code (the models block builds every model on the meta device)."""
    return {name: docgen.generate(name) for name in NAMES}


@pytest.fixture
def cached(monkeypatch, texts):
    """BLOCKS answering this module's texts, so a check or write does not build every model again."""
    for name, block in list(docgen.BLOCKS.items()):
        monkeypatch.setitem(docgen.BLOCKS, name, docgen.Block(block.file, lambda text=texts[name]: text))
    return texts


def files() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, block in docgen.BLOCKS.items():
        out.setdefault(block.file, []).append(name)
    return out


def skeleton(root: Path) -> None:
    """The docs as an author leaves them: prose around each block's markers, stale text between them."""
    for file, names in files().items():
        parts = [f"# {file}\n\nProse before the blocks.\n"]
        for name in names:
            start, end = docgen.markers(name)
            parts.append(f"{start}\nstale text of {name}\n{end}\n\nProse after {name}.\n")
        path = root / file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(parts), encoding="utf-8")


@pytest.fixture
def synced(tmp_path, cached) -> Path:
    skeleton(tmp_path)
    changed = docgen.write(tmp_path)
    assert sorted(changed) == sorted({tmp_path / f for f in files()})
    return tmp_path


def body(root: Path, name: str) -> str:
    text = (root / docgen.BLOCKS[name].file).read_text(encoding="utf-8")
    start, end = docgen.markers(name)
    return text.split(start + "\n", 1)[1].split(end, 1)[0]


@pytest.mark.parametrize("name", NAMES)
def test_blocks_are_deterministic(name, texts, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # argparse's usage wraps at docgen.markdown.WIDTH, not the terminal's
    again = docgen.generate(name)
    assert again == texts[name]
    assert again.strip()


@pytest.mark.parametrize("name", NAMES)
def test_tables_escape_pipes(name, texts):
    """Every row of a table has its header's cell count: a `|` inside a cell is escaped."""
    width = None
    for line in texts[name].splitlines() + [""]:
        if not line.startswith("|"):
            width = None
            continue
        cells = len(re.findall(r"(?<!\\)\|", line))
        width = width or cells
        assert cells == width, line


def test_cli_block_covers_every_subcommand(texts):
    parser = cli_parser()
    for command in subparsers(parser).choices:
        assert f"\n### kdbench {command}\n" in texts["cli"]
    assert "| `--run-id` | `ID` |" in texts["cli"]
    assert "examples:" in texts["cli"]


def test_cell_keys_block_covers_nested_and_method_keys(texts):
    keys = re.findall(r"^\| `([^`]+)` \|", texts["cell-keys"], re.M)
    assert {"timing.warmup", "data.shape", "kd.temperature", "dkd.warmup", "rkd.eps"} <= set(keys)
    assert all(f"{m}" in keys for m in registered_methods())
    warmup = next(line for line in texts["cell-keys"].splitlines() if line.startswith("| `timing.warmup` "))
    assert "| `3` |" in warmup and "`0 <= x <= 100000`" in warmup


def test_write_then_check_agrees_and_keeps_the_prose(synced, texts):
    assert docgen.check(synced) == []
    assert docgen.write(synced) == []  # nothing left to change
    for name in NAMES:
        assert body(synced, name) == texts[name] + "\n"
    suites = (synced / "docs/suites.md").read_text(encoding="utf-8")
    assert suites.startswith("# docs/suites.md\n\nProse before the blocks.\n")
    assert suites.endswith("Prose after suites.\n")
    assert "stale text" not in suites


@pytest.mark.parametrize("name", NAMES)
def test_check_names_an_edited_block(synced, name, capsys):
    path = synced / docgen.BLOCKS[name].file
    text = path.read_text(encoding="utf-8")
    last = body(synced, name).splitlines()[-1]
    path.write_text(text.replace(last + "\n", last + " edited by hand\n", 1), encoding="utf-8")

    stale = docgen.check(synced)
    assert len(stale) == 1
    assert f"{docgen.BLOCKS[name].file}: generated block {name} is stale" in stale[0]
    assert docgen.main(["--check", "--root", str(synced)]) == 1
    assert f"generated block {name} is stale" in capsys.readouterr().err

    assert docgen.main(["--root", str(synced)]) == 0
    assert capsys.readouterr().out.splitlines() == [docgen.BLOCKS[name].file]
    assert docgen.main(["--check", "--root", str(synced)]) == 0


def test_missing_markers_are_an_error(synced):
    methods = synced / "docs/methods.md"
    methods.write_text("# Methods\n\nno block here\n", encoding="utf-8")
    (synced / "docs/results.md").unlink()
    stale = docgen.check(synced)
    assert "docs/methods.md has no generated block methods" in stale
    assert any(s.startswith("docs/results.md is missing") for s in stale)
    with pytest.raises(docgen.DocgenError, match="docs/methods.md has no generated block methods"):
        docgen.write(synced)
    assert methods.read_text(encoding="utf-8") == "# Methods\n\nno block here\n"  # nothing written
    assert docgen.main(["--root", str(synced)]) == 2


@pytest.fixture
def warmup_five(monkeypatch):
    """The schema with one default edited: timing.warmup 3 -> 5 (on the field pydantic and docgen read)."""
    from kdbench.config import schema

    monkeypatch.setattr(schema.TimingConfig.model_fields["warmup"], "default", 5)
    # a cell starts from its `timing` field's default instance, made when the class was defined
    monkeypatch.setattr(schema.CellConfig.model_fields["timing"], "default", schema.TimingConfig(warmup=5))


def test_check_fails_when_the_schema_drifts(synced, monkeypatch, request):
    # the real cell-keys generator (not this module's text): it agrees with docs generated before the edit ...
    monkeypatch.setitem(docgen.BLOCKS, "cell-keys", docgen.Block("docs/suites.md", cell_keys))
    assert docgen.check(synced) == []
    # ... and not after a default in the schema changes
    request.getfixturevalue("warmup_five")
    row = next(line for line in cell_keys().splitlines() if line.startswith("| `timing.warmup` "))
    assert "| `5` |" in row
    stale = docgen.check(synced)
    assert len(stale) == 1
    assert stale[0].startswith("docs/suites.md: generated block cell-keys is stale")
    assert "timing.warmup" in stale[0]


def test_import_is_cheap():
    code = "import sys, kdbench.docgen; assert 'torch' not in sys.modules and 'pydantic' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_repository_docs_are_in_sync(cached):
    """The committed docs agree with the code: regenerate with `python -m kdbench.docgen`."""
    assert docgen.check(ROOT) == []


def test_suites_block_gives_each_suite_its_one_recorded_time(texts):
    rows = {line.split(" | ")[0]: line for line in texts["suites"].splitlines() if line.startswith("| `suites/")}
    assert len(rows) == len(list((ROOT / "suites").glob("*.yaml")))
    assert rows["| `suites/cpu.yaml` (`cpu-quick`)"].startswith("| `suites/cpu.yaml` (`cpu-quick`) | 4 | ")
    cpu = suite_times(ROOT / "suites")["cpu.yaml"]  # the one recorded figure, as suites/times.toml has it
    assert f"| {cpu.cpu_text()}; {cpu.date}; " in rows["| `suites/cpu.yaml` (`cpu-quick`)"]
    quality = rows["| `suites/quality.yaml`"]
    assert "| 8 + quality | " in quality and "| not measured; " in quality


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings (lower case, punctuation dropped, spaces as -)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    count: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{count[slug]}" if slug in count else slug)  # a repeated heading: slug-1, slug-2
        count[slug] = count.get(slug, 0) + 1
    return anchors


def test_every_relative_link_of_the_front_page_and_the_manual_resolves():
    """Links moved between README.md and docs/ (issue 32) still reach their file and heading."""
    broken = []
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
