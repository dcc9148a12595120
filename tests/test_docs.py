"""The docs stay current: the README is one screen, the topic pages exist and every link between
them resolves, and the tables made from the code (``scripts/make_docs.py``) match the code."""

from __future__ import annotations

import re
from pathlib import Path

from torchtitan_autoparallel.titan import with_generated
from torchtitan_autoparallel.titan.keys import legend
from torchtitan_autoparallel.titan.v0_2.settings import settings_table

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def test_readme_is_one_screen_and_the_rest_is_in_docs():
    assert len((REPO / "README.md").read_bytes()) <= 15_000
    assert len(list(DOCS.glob("*.md"))) >= 5


def test_links_resolve():
    for page in [REPO / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_the_settings_table_is_current():
    """Stale when settings.SETTINGS changed without ``python scripts/make_docs.py``."""
    text = (DOCS / "settings.md").read_text()
    assert with_generated(text, "v0_2 settings", settings_table()) == text, (
        "docs/settings.md is stale: run python scripts/make_docs.py")


def test_the_key_handling_legend_is_current():
    """Both releases' tables share one vocabulary (``titan/keys.py``); its legend is current."""
    text = (DOCS / "settings.md").read_text()
    assert with_generated(text, "key handling", legend()) == text, (
        "docs/settings.md is stale: run python scripts/make_docs.py")


def test_a_stale_table_is_noticed():
    text = (DOCS / "settings.md").read_text()
    stale = text.replace("| `job.config_file` |", "| `job.config_fil` |", 1)
    assert stale != text
    assert with_generated(stale, "v0_2 settings", settings_table()) != stale
