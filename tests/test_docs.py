"""The docs stay true: the config reference matches the schema, links resolve, troubleshooting quotes real messages."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NEW_DOCS = ("quickstart.md", "migrating-from-pbg.md", "config-reference.md", "troubleshooting.md")


def test_config_reference_is_up_to_date() -> None:
    result = subprocess.run([sys.executable, str(DOCS / "gen_config_reference.py"), "--check"], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_config_reference_lists_every_key_with_its_help() -> None:
    import dataclasses

    from job.config import ConfigSchema, EntitySchema, RelationSchema

    text = (DOCS / "config-reference.md").read_text()
    for cls, prefix in ((ConfigSchema, ""), (EntitySchema, "entities.<type>."), (RelationSchema, "relations[i].")):
        for field in dataclasses.fields(cls):
            row = next((line for line in text.splitlines() if line.startswith(f"| `{prefix}{field.name}`")), None)
            assert row is not None, f"{prefix}{field.name} missing from config-reference.md"
            assert " ".join(field.metadata["help"].split())[:40].replace("|", "\\|") in row
    assert "`pushgateway_url` *(not in PBG 1.0)*" in text and "| `dimension` | `int` | **required** |" in text


@pytest.mark.parametrize("name", NEW_DOCS)
def test_relative_links_resolve(name: str) -> None:
    text = (DOCS / name).read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (DOCS / target).exists(), f"{name}: broken link {target}"


def _source_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "job").rglob("*.py")))


def test_troubleshooting_quotes_messages_the_code_prints() -> None:
    """Each heading's literal parts (between <placeholders>) must occur in job/, so no entry is invented."""
    source = _source_text()
    headings = [line[4:] for line in (DOCS / "troubleshooting.md").read_text().splitlines() if line.startswith("### `")]
    assert len(headings) >= 25
    for heading in headings:
        for message in re.findall(r"`([^`]+)`", heading):
            parts = [p.strip(" ':/()") for p in re.split(r"<[^>]+>|\(expected |\(\.\.\.\)|\.\.\.", message)]
            literal = [p for p in parts if len(p) >= 8]
            assert literal, message
            assert any(p in source for p in literal), f"troubleshooting.md: no part of {message!r} is in the code"


def test_every_troubleshooting_entry_has_a_fix() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    entries = re.split(r"^### ", text, flags=re.M)[1:]
    for entry in entries:
        assert "**Fix:**" in entry, entry.splitlines()[0]


def test_quickstart_commands_exist() -> None:
    from job.cli import build_parser

    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    text = (DOCS / "quickstart.md").read_text() + (DOCS / "migrating-from-pbg.md").read_text()
    code_lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            code_lines.append(line)
    code = "\n".join(code_lines)
    used = set(re.findall(r"`biggraph ([a-z][a-z-]+)", text)) | set(re.findall(r"(?:^|bin/)biggraph ([a-z][a-z-]+)", code, re.M))
    assert {"demo", "report", "import", "train", "submit"} <= used
    unknown = used - commands
    assert not unknown, f"docs use commands that do not exist: {sorted(unknown)}"
    assert "report" in commands
