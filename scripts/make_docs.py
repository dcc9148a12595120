"""Write the docs' tables made from the code (docs/settings.md): the key-handling legend from
``titan/keys.py``, TorchTitan 0.2.2's settings table from ``titan/v0_2/settings.py`` under 0.2.2,
0.3.0's key table from ``titan/v0_3/job.py`` under 0.3.0 (run it once in each release's
environment).

    python scripts/make_docs.py          # the legend and the installed release's table
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

from torchtitan_autoparallel.titan import with_generated
from torchtitan_autoparallel.titan.keys import legend

SETTINGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def main() -> None:
    if version("torchtitan").startswith("0.3."):
        from torchtitan_autoparallel.titan.v0_3.settings import settings_table
        name, body = "v0_3 keys", settings_table()
    else:
        from torchtitan_autoparallel.titan.v0_2.settings import settings_table
        name, body = "v0_2 settings", settings_table()
    text = with_generated(SETTINGS_DOC.read_text(), "key handling", legend())
    SETTINGS_DOC.write_text(with_generated(text, name, body))
    print(f"wrote the key handling legend and the {name} table to {SETTINGS_DOC}")


if __name__ == "__main__":
    main()
