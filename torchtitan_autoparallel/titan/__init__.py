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


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """``rows`` under ``header`` as a Markdown table (``|`` in a cell escaped)."""
    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def with_generated(text: str, name: str, body: str) -> str:
    """``text`` with the part between ``<!-- begin generated: name -->`` and ``<!-- end
    generated: name -->`` replaced by ``body`` (the docs' tables made from the code)."""
    begin, end = f"<!-- begin generated: {name} -->", f"<!-- end generated: {name} -->"
    head, found, rest = text.partition(begin)
    if not found or end not in rest:
        raise ValueError(f"no {begin} ... {end} in the text")
    return f"{head}{begin}\n{body}\n{end}{rest.partition(end)[2]}"
