"""The repository explains itself: README and docs/ stay true to the code.

- the settings table in docs/configuration.md is what ``star config show
  --markdown`` prints for the defaults;
- nothing points outside the repository, and no comment cites a design
  document other than docs/design.md;
- the README stays a five-minute read (at most 200 lines), its test command is
  the one ``.ci/run`` runs, and every docs/ page it links exists.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from star.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# Spelled in two pieces so this file does not match itself.
OUTSIDE = ("../" + "shared", "/work/" + "shared", "DESIGN" + ".md", "DESIGN" + " §")
SKIP_DIRS = {
    ".git",
    "build",
    "node_modules",
    ".venv",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    ".benchmarks",
}


def _block(text: str, name: str) -> str:
    match = re.search(rf"<!-- {name} -->\n(.*?)<!-- /{name} -->", text, re.S)
    assert match, f"no <!-- {name} --> block"
    return match.group(1)


def test_settings_table_is_what_config_show_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("STAR_"):
            monkeypatch.delenv(key)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config", "show", "--markdown"]) == 0
    table = _block((DOCS / "configuration.md").read_text(), "settings-table")
    assert table == out.getvalue(), (
        "docs/configuration.md's settings table differs from `star config show --markdown`: "
        "paste that command's output (no STAR_* variables set) between the settings-table markers"
    )


SUFFIXES = {".py", ".md", ".toml", ".sh", ".service", ".example", ".cfg", ".txt"}


def _texts() -> list[Path]:
    out = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out.extend(Path(top) / f for f in files if Path(f).suffix in SUFFIXES)
    return out


def test_nothing_points_outside_the_repository() -> None:
    found = []
    for path in _texts():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        for needle in OUTSIDE:
            if needle in text:
                found.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_readme_is_short_and_runs_the_ci_command() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    block = _block(text, "test-command")
    assert [line for line in block.splitlines() if line and not line.startswith("```")] == [
        "python -m pytest -q"
    ]


def test_docs_the_readme_links_exist() -> None:
    text = README.read_text()
    links = set(re.findall(r"docs/[\w./-]+\.(?:md|json|txt|xz|png)", text))
    assert links
    missing = sorted(link for link in links if not (ROOT / link).exists())
    assert not missing, f"README links missing files: {missing}"
