"""How ``parallelism.auto`` handles a TorchTitan config key: one vocabulary for every release.

Each release package declares its key table with these words (``settings.py``'s ``SETTINGS``
in ``v0_2`` and ``v0_3``): a key has one or more handlings, ``PASSED`` alone;
docs/settings.md's per-key tables and their legend are written from here
(``scripts/make_docs.py``)."""

from __future__ import annotations

from enum import Enum


class KeyHandling(str, Enum):
    """What auto does with a key (a key may have several)."""

    SEARCHED = "searched"
    CONSTRAINT = "constraint"
    APPLIED = "applied"
    COSTED = "costed"
    NOTED = "noted"
    REFUSED = "refused"
    PASSED = "passed"


SEARCHED, CONSTRAINT, APPLIED, COSTED, NOTED, REFUSED, PASSED = (
    KeyHandling.SEARCHED, KeyHandling.CONSTRAINT, KeyHandling.APPLIED, KeyHandling.COSTED,
    KeyHandling.NOTED, KeyHandling.REFUSED, KeyHandling.PASSED)

MEANING = {
    SEARCHED: "the planner chooses it",
    CONSTRAINT: "it restricts the search (a degree or schedule set by you is fixed)",
    APPLIED: "run as set under every plan",
    COSTED: "the cost model charges for it",
    NOTED: "run as set; the plan's notes say what the cost model does not see of it",
    REFUSED: "one line before any rank starts, for the values the note names (every value "
             "when it names none)",
    PASSED: "passed to TorchTitan as set: it changes neither parallel execution, memory nor "
            "step time",
}
"""What each handling means (docs/settings.md's legend)."""

Handling = tuple[KeyHandling, ...]


def check_handling(key: str, handling: Handling) -> None:
    """A row's handling: one or more words, each once, ``PASSED`` alone."""
    if not handling or len(set(handling)) != len(handling) or not all(
            isinstance(h, KeyHandling) for h in handling):
        raise ValueError(f"{key}: handling {handling!r} is not one or more KeyHandling words")
    if PASSED in handling and len(handling) > 1:
        raise ValueError(f"{key}: passed goes alone, not with {handling!r}")


def handling_words(handling: Handling) -> str:
    """A row's handling as the docs' tables write it ("applied, refused")."""
    return ", ".join(h.value for h in handling)


def legend() -> str:
    """docs/settings.md's legend of both releases' per-key tables."""
    return "\n".join(f"- **{h.value}**: {MEANING[h]}" for h in KeyHandling)


def handling_table(rows: list[tuple[str, Handling, str]]) -> str:
    """``(key as shown, handling, note)`` rows as a Markdown table (both releases' columns)."""
    from . import markdown_table

    for key, handling, _ in rows:
        check_handling(key, handling)
    return markdown_table(("key", "under auto", "note"),
                          [(key, handling_words(handling), note) for key, handling, note in rows])
