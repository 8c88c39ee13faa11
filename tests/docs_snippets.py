"""Read markdown pages for tests: fenced code blocks (to run what the docs show), and the
entries of docs/errors.md."""

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


_ERROR_ENTRY = re.compile(r"^### (?P<title>.+?)\n(?P<body>.*?)(?=^##|\Z)",
                          re.MULTILINE | re.DOTALL)


def error_entries() -> list[tuple[str, str, str]]:
    """docs/errors.md's entries: (title, the **Raised:** type, the **Message contains:** text)."""
    out = []
    for m in _ERROR_ENTRY.finditer((DOCS / "errors.md").read_text()):
        raised = re.search(r"\*\*Raised:\*\* `(\w+)`", m["body"])
        text = re.search(r"\*\*Message contains:\*\* `([^`]+)`", m["body"])
        assert raised and text, f"docs/errors.md: entry {m['title']!r} lacks Raised/Message"
        out.append((m["title"].strip(), raised[1], text[1]))
    return out
