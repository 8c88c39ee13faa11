"""Read the fenced code blocks out of a markdown page, so tests can run what the docs show."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def code_blocks(page: str, language: str = "python") -> list[str]:
    """Every ```language block of ``docs/<page>``, in page order."""
    text = (DOCS / page).read_text()
    return [body for lang, body in _FENCE.findall(text) if lang == language]


def block_containing(page: str, marker: str, language: str = "python") -> str:
    """The one ```language block of ``docs/<page>`` that contains ``marker``."""
    found = [b for b in code_blocks(page, language) if marker in b]
    if len(found) != 1:
        raise AssertionError(f"docs/{page}: expected one {language} block containing "
                             f"{marker!r}, found {len(found)}")
    return found[0]
