"""docs/settings.md's TorchTitan 0.3.0 key table matches ``titan/v0_3/settings.py``'s ``SETTINGS``
(``python scripts/make_docs.py`` in the 0.3.0 environment writes it)."""

from __future__ import annotations

from pathlib import Path

from torchtitan_autoparallel.titan import with_generated
from torchtitan_autoparallel.titan.v0_3.settings import SETTINGS, settings_table

SETTINGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def test_the_0_3_key_table_is_current():
    text = SETTINGS_DOC.read_text()
    assert with_generated(text, "v0_3 keys", settings_table()) == text, (
        "docs/settings.md is stale: run python scripts/make_docs.py under TorchTitan 0.3.0")
    for key in SETTINGS:
        assert f"`--{key}" in text, key
