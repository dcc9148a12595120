#!/usr/bin/env python
"""Build the offline training assets used by ``torchtitan_autoparallel.titan.v0_2.data``.

Writes, relative to the repository root:

* ``assets/data/corpus.jsonl``: one ``{"text": ...}`` object per line, one document
  per docstring of the CPython standard library (modules, classes, functions,
  methods) followed by one per topic of the language reference shipped in
  ``pydoc_data.topics``; deduplicated, whitespace-normalised, capped at
  ``MAX_CORPUS_BYTES``.
* ``assets/tokenizer/tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE
  tokenizer (vocab ``VOCAB_SIZE``) trained on that corpus, loadable by
  ``torchtitan.components.tokenizer.HuggingFaceTokenizer``.

The output is deterministic for a given interpreter build and set of installed
standard-library extension modules: the script re-executes itself with
``PYTHONHASHSEED=0``, walks modules and attributes in sorted order and drops
docstrings that embed memory addresses or installation paths.

Usage: ``python scripts/make_assets.py [--out-dir DIR]`` (default: the package folder,
``torchtitan_autoparallel``, whose ``assets`` ship in the wheel).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

VOCAB_SIZE = 2000  # must stay below 2048, the vocab size of TorchTitan's debug models
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
MAX_CORPUS_BYTES = 6_000_000
MIN_DOC_CHARS = 40

# Top-level modules never imported (side effects, GUI, self-modifying, non-stdlib copies).
BLOCKED = (
    "antigravity", "this", "idlelib", "tkinter", "_tkinter", "turtle", "turtledemo",
    "readline", "test", "lib2to3", "distutils", "ensurepip", "venv",
)
# Submodule name components that are never imported (scripts, test suites).
SKIPPED_PARTS = {"__main__", "test", "tests", "idle_test"}


DESCRIPTORS = (property, classmethod, staticmethod)


def _iter_module_names() -> Iterator[str]:
    """Yield public stdlib module names (and their submodules), sorted, depth first."""

    def walk(name: str) -> Iterator[str]:
        yield name
        mod = sys.modules.get(name)
        path = getattr(mod, "__path__", None)
        if path is None:
            return
        subs = sorted(info.name for info in pkgutil.iter_modules(list(path)))
        for sub in subs:
            if not sub.startswith("_") and sub not in SKIPPED_PARTS:
                if _import(f"{name}.{sub}") is not None:
                    yield from walk(f"{name}.{sub}")

    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in BLOCKED:
            continue
        if _import(name) is not None:
            yield from walk(name)


def _import(name: str) -> ModuleType | None:
    """Import ``name`` quietly; return ``None`` on any failure."""
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), \
                contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except (Exception, SystemExit):
        return None


def _owned(obj: object, modname: str) -> bool:
    """True if ``obj`` was defined in module ``modname`` (or one of its submodules)."""
    owner = getattr(obj, "__module__", None)
    return isinstance(owner, str) and (owner == modname or owner.startswith(modname + "."))


def _iter_docstrings(mod: ModuleType) -> Iterator[str | None]:
    """Yield raw docstrings of a module and of the classes/functions it defines."""
    yield mod.__doc__
    for name in sorted(dir(mod)):
        obj = getattr(mod, name, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)) or not _owned(obj, mod.__name__):
            continue
        yield getattr(obj, "__doc__", None)
        if inspect.isclass(obj):
            members = vars(obj)
            for attr in sorted(members):
                value = members[attr]
                if inspect.isroutine(value) or isinstance(value, DESCRIPTORS):
                    yield getattr(value, "__doc__", None)


def _normalise(doc: object) -> str | None:
    """Collapse whitespace; reject short, address- or path-dependent docstrings."""
    if not isinstance(doc, str):
        return None
    text = " ".join(doc.split())
    if len(text) < MIN_DOC_CHARS or " at 0x" in text:
        return None
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.expanduser("~")}
    if any(p and len(p) > 1 and p in text for p in prefixes):
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return text


def _iter_raw_documents() -> Iterator[str | None]:
    """Yield stdlib docstrings, then the ``pydoc`` language-reference topics."""
    for modname in _iter_module_names():
        mod = sys.modules.get(modname)
        if mod is not None:
            yield from _iter_docstrings(mod)
    topics = getattr(_import("pydoc_data.topics"), "topics", {})
    for key in sorted(topics):
        yield topics[key]


def build_corpus() -> list[str]:
    """Collect deduplicated, normalised documents up to ``MAX_CORPUS_BYTES``."""
    for name in BLOCKED:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # blocks transitive imports
    seen: set[str] = set()
    docs: list[str] = []
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raws = list(_iter_raw_documents())
    for raw in raws:
        text = _normalise(raw)
        if text is None or text in seen:
            continue
        size = len(json.dumps({"text": text}, ensure_ascii=False).encode("utf-8")) + 1
        if total + size > MAX_CORPUS_BYTES:
            break
        seen.add(text)
        docs.append(text)
        total += size
    return docs


def write_corpus(docs: list[str], path: Path) -> None:
    """Write ``docs`` as JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for text in docs:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def train_tokenizer(docs: list[str], out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer and write TorchTitan-compatible files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)

    def added(token: str) -> dict[str, object]:
        return {"content": token, "lstrip": False, "normalized": False,
                "rstrip": False, "single_word": False, "special": True}

    config = {
        "add_bos_token": False,  # TorchTitan passes add_bos/add_eos explicitly
        "add_eos_token": False,
        "added_tokens_decoder": {str(tok.token_to_id(t)): added(t) for t in (BOS, EOS)},
        "bos_token": BOS,
        "eos_token": EOS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    """Entry point."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path,
                        default=Path(__file__).resolve().parents[1] / "torchtitan_autoparallel")
    args = parser.parse_args()
    # Do not let files next to this script shadow stdlib modules.
    script_dir = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(script_dir)]

    docs = build_corpus()
    corpus = args.out_dir / "assets" / "data" / "corpus.jsonl"
    write_corpus(docs, corpus)
    train_tokenizer(docs, args.out_dir / "assets" / "tokenizer")
    print(f"wrote {len(docs)} documents ({corpus.stat().st_size} bytes) to {corpus}")
    print(f"wrote tokenizer (vocab {VOCAB_SIZE}) to {args.out_dir / 'assets' / 'tokenizer'}")


if __name__ == "__main__":
    main()
