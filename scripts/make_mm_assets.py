#!/usr/bin/env python
"""Build the offline multimodal assets for TorchTitan 0.3.0's VLM debug configs on this machine.

Writes, relative to the repository root (deterministic for a given Pillow build):

* ``assets/tokenizer_mm/``: ``assets/tokenizer`` with the special tokens of the
  ``MultiModalTokenizer`` of Qwen3.5 and Kimi K2.5 (``QWEN3_5_SPECIAL_TOKENS``,
  ``KIMI_K2_5_SPECIAL_TOKENS``) added after its vocabulary (ids 2000..2008, below the debug
  models' vocabularies); the text tokenizer other tests read is left as it is.
* ``assets/cc12m_test/cc12m_test-000.tar``: a webdataset shard in the layout of TorchTitan's
  ``tests/assets/cc12m_test`` (``<key>.jpg`` + ``<key>.txt`` per sample), ``NUM_SAMPLES`` small
  JPEG images (random colour blocks) captioned with the opening words of documents of
  ``assets/data/corpus.jsonl``.

Usage: ``python scripts/make_mm_assets.py [--out-dir DIR]`` (default: the package folder,
``torchtitan_autoparallel``, whose ``assets`` ship in the wheel).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import tarfile
from pathlib import Path

NUM_SAMPLES = 48
IMAGE_SIDE = 32  # the loader resizes to its pixel budget (min_pixels 256 x 256)
CAPTION_WORDS = 24
SPECIAL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>",
                  "<|endoftext|>",  # Qwen3.5
                  "<|media_pad|>", "<|media_begin|>", "<|media_end|>", "[PAD]")  # Kimi K2.5
ROOT = Path(__file__).resolve().parents[1] / "torchtitan_autoparallel"


def write_tokenizer(src: Path, out: Path) -> None:
    """``src``'s tokenizer with ``SPECIAL_TOKENS`` added (ids from its vocabulary size on)."""
    tok = json.loads((src / "tokenizer.json").read_text())
    config = json.loads((src / "tokenizer_config.json").read_text())
    next_id = len(tok["model"]["vocab"])
    for i, content in enumerate(SPECIAL_TOKENS):
        entry = {"content": content, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True}
        tok["added_tokens"].append({"id": next_id + i, **entry})
        config["added_tokens_decoder"][str(next_id + i)] = entry
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok, indent=2, ensure_ascii=False) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _image(rng: random.Random) -> bytes:
    """A small JPEG: a 4 x 4 grid of random colours."""
    from PIL import Image

    img = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE))
    cell = IMAGE_SIDE // 4
    for y in range(0, IMAGE_SIDE, cell):
        for x in range(0, IMAGE_SIDE, cell):
            colour = tuple(rng.randrange(256) for _ in range(3))
            img.paste(colour, (x, y, x + cell, y + cell))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=75)
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shard(corpus: Path, out: Path) -> None:
    """``NUM_SAMPLES`` image-caption pairs as one webdataset tar under ``out``."""
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    rng = random.Random(0)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tarfile.open(out / "cc12m_test-000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(NUM_SAMPLES):
            key = f"{i:06d}"
            caption = " ".join(docs[rng.randrange(len(docs))].split()[:CAPTION_WORDS])
            _add(tar, f"{key}.jpg", _image(rng))
            _add(tar, f"{key}.txt", caption.encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT)
    out = parser.parse_args().out_dir
    write_tokenizer(ROOT / "assets" / "tokenizer", out / "assets" / "tokenizer_mm")
    write_shard(ROOT / "assets" / "data" / "corpus.jsonl", out / "assets" / "cc12m_test")


if __name__ == "__main__":
    main()
