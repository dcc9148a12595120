"""One package per TorchTitan release: how a job is read, how its model is built on meta, and
how a Plan is applied with that release's helpers. The planning pipeline imports none of them
(``frontend.frontend()`` loads the installed release's)."""

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
"""The package's offline training assets (shipped in the wheel): the debug tokenizer
(``tokenizer``, vocabulary 2000), a text corpus (``data/corpus.jsonl``), and for the multimodal
configs that tokenizer with vision tokens (``tokenizer_mm``) and an image-caption shard
(``cc12m_test``). Configs name them as ``./assets/...``; a path that does not exist relative to
the working directory is read from here."""
