"""Module docstrings as ``--help`` text: the reStructuredText markup a reader of the source
sees (````code````, ``:func:`name```, ``**bold**``) stripped, so a terminal shows plain words."""

from __future__ import annotations

import re

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :func:`mini_ddp.run_ranks` -> mini_ddp.run_ranks


def plain(doc: str | None) -> str:
    """``doc`` without reStructuredText roles, literals and emphasis markers."""
    text = _ROLE.sub(r"\1", doc or "")
    return text.replace("``", "").replace("**", "")
