"""Regenerate ``features_v0_2_2.json`` from TorchTitan's integration feature matrix.

Reads ``tests/integration_tests/features.py`` at a tag of a TorchTitan git checkout and writes
every ``OverrideDefinitions`` (disabled ones included) as data; the module is parsed, not
imported. Usage: ``python tests/torchtitan_features/regenerate.py [git dir] [tag]`` (a
TorchTitan git checkout; default tag ``TAG``; ``release/0.3`` writes
``features_v0_3_0.json``: TorchTitan 0.3.0's matrix, read from its release branch, whose head
the source line names, where the checkout has no ``v0.3.0`` tag). Without arguments: from
``VENDORED``, the file at ``TAG`` kept here.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

TAG = "v0.2.2"
SOURCE = "tests/integration_tests/features.py"
HERE = Path(__file__).resolve().parent
OUT = HERE / "features_v0_2_2.json"
OUTPUTS = {"v0.2.2": OUT, "v0.3.0": HERE / "features_v0_3_0.json",
           "release/0.3": HERE / "features_v0_3_0.json"}
"""Where each release's matrix is written."""
VENDORED = HERE / "features_v0_2_2.py.txt"
"""``SOURCE`` at ``TAG``, kept beside the JSON (BSD 3-Clause, the LICENSE file here) so the
JSON is checked against it on any machine."""
VENDORED_BLOB = "1c9ac0478521f9e35195972257d4b14507f39f41"
"""Its git blob id at ``TAG`` (``git rev-parse v0.2.2:tests/integration_tests/features.py``)."""
CHECKPOINT_PATH = "{checkpoint_path}"
"""Stands for the module's ``checkpoint_path`` (an HF checkpoint the previous run saved)."""

FIELDS = ("override_args", "test_descr", "test_name", "ngpu", "disabled", "skip_rocm_test")
DEFAULTS: dict[str, Any] = {"test_descr": "default", "test_name": "default", "ngpu": 4,
                            "disabled": False, "skip_rocm_test": False}


def _value(node: ast.expr) -> Any:
    """A literal, with the f-string over ``checkpoint_path`` kept as a placeholder."""
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name) \
                    and value.value.id == "checkpoint_path":
                parts.append(CHECKPOINT_PATH)
            else:
                raise ValueError(f"unexpected f-string part at line {node.lineno}")
        return "".join(parts)
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(item) for item in node.elts]
    return ast.literal_eval(node)


def definitions(source: str) -> list[dict[str, Any]]:
    """Every ``OverrideDefinitions(...)`` call of ``source``, in order, with defaults filled."""
    cases = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "OverrideDefinitions":
            case = dict(DEFAULTS)
            case.update(zip(FIELDS, (_value(arg) for arg in node.args), strict=False))
            case.update({kw.arg: _value(kw.value) for kw in node.keywords if kw.arg})
            cases.append((node.lineno, {field: case[field] for field in FIELDS}))
    return [case for _, case in sorted(cases, key=lambda item: item[0])]


def source_at(git_dir: str, tag: str) -> str:
    """``SOURCE`` at ``tag`` in the TorchTitan git checkout ``git_dir``."""
    return subprocess.run(["git", "-C", git_dir, "show", f"{tag}:{SOURCE}"], check=True,
                          capture_output=True, text=True).stdout


def git_blob_id(data: bytes) -> str:
    """The id git gives a file of ``data`` (sha1 of its blob header and bytes)."""
    import hashlib

    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def main(argv: list[str]) -> None:
    """Write the JSON for ``argv[0]`` (a TorchTitan git dir; none: the vendored source at
    ``TAG``) at ``argv[1]`` (default TAG)."""
    tag = argv[1] if len(argv) > 1 else TAG
    if not argv:
        source, name = VENDORED.read_text(), TAG
    else:
        git_dir = argv[0]
        source, name = source_at(git_dir, tag), tag
        if not tag.startswith("v"):  # a branch: name its head
            head = subprocess.run(["git", "-C", git_dir, "rev-parse", "--short=10", tag],
                                  check=True, capture_output=True, text=True).stdout.strip()
            name = f"{tag} @ {head}"
    out = OUTPUTS.get(tag, OUT)
    data = {"source": f"pytorch/torchtitan {name}:{SOURCE}",
            "license": "(c) Meta Platforms, Inc. and affiliates; BSD 3-Clause, the LICENSE "
                       "file next to this one",
            "checkpoint_path_placeholder": CHECKPOINT_PATH, "definitions": definitions(source)}
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data['definitions'])} definitions written to {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
