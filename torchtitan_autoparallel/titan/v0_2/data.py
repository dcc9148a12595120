"""Offline training data: the ``autoparallel_text`` corpus and a DP-invariant data loader.

The corpus (``assets/data/corpus.jsonl``) and tokenizer (``assets/tokenizer``), package data,
are built by ``scripts/make_assets.py``. :func:`build_global_batch_dataloader` cuts one cyclic
token stream into fixed samples so that training step ``s`` consumes samples
``[s*G, (s+1)*G)`` whatever the data-parallel degree and gradient-accumulation split.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from .. import ASSETS

DEFAULT_CORPUS = ASSETS / "data" / "corpus.jsonl"
DEFAULT_TOKENIZER = ASSETS / "tokenizer"
DATASET_NAME = "autoparallel_text"
DATASET_NAMES: tuple[str, ...] = (DATASET_NAME,)

_STREAMS: dict[tuple[Any, ...], torch.Tensor] = {}


def read_texts(path: str | os.PathLike[str]) -> list[str]:
    """Return the ``text`` field of every line of a JSON-lines file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def _load_corpus(path: str) -> Any:
    """TorchTitan dataset loader: the corpus as an in-memory ``datasets.Dataset``."""
    from datasets import Dataset

    return Dataset.from_list([{"text": t} for t in read_texts(path)])


def _sample_text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Add ``autoparallel_text`` to TorchTitan's dataset registry (idempotent)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[DATASET_NAME] = DatasetConfig(
        path=str(DEFAULT_CORPUS), loader=_load_corpus, sample_processor=_sample_text
    )


def corpus_path(job_config: Any) -> Path:
    """The corpus file: ``training.dataset_path`` if set, else the bundled corpus."""
    override = getattr(job_config.training, "dataset_path", None)
    return Path(override).expanduser().resolve() if override else DEFAULT_CORPUS


def token_stream(corpus: str | os.PathLike[str], tokenizer: Any) -> torch.Tensor:
    """All documents tokenized (BOS + text + EOS) and concatenated; cached in memory."""
    corpus = Path(corpus).resolve()
    tok_dir = getattr(tokenizer, "tokenizer_path", None)
    tok_file = Path(tok_dir, "tokenizer.json").resolve() if tok_dir else None
    key = (
        str(corpus),
        corpus.stat().st_mtime_ns,
        str(tok_file) if tok_file else id(tokenizer),
        tok_file.stat().st_mtime_ns if tok_file and tok_file.exists() else None,
    )
    if key not in _STREAMS:
        ids = [tokenizer.encode(t, add_bos=True, add_eos=True) for t in read_texts(corpus)]
        _STREAMS[key] = torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long)
    return _STREAMS[key]


class GlobalBatchDataLoader(BaseDataLoader):
    """Yields ``({"input": x}, labels)`` batches of shape ``[local_batch_size, seq_len]``.

    Sample ``j`` is ``tokens[j*seq_len : j*seq_len + seq_len + 1]`` (cyclic); the ``i``-th batch
    of rank ``r`` (``i = s*A + k``) holds samples ``s*G + k*W*lb + r*lb + [0, lb)`` with ``W``
    the DP degree, ``lb`` the local batch and ``A = G // (W*lb)`` accumulation steps.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        local_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
    ) -> None:
        if global_batch_size < 0:
            global_batch_size = local_batch_size * dp_world_size
        per_micro_step = local_batch_size * dp_world_size
        if min(seq_len, local_batch_size, dp_world_size, global_batch_size) <= 0:
            raise ValueError("seq_len, batch sizes and dp_world_size must be positive")
        if global_batch_size % per_micro_step:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not a multiple of local_batch_size "
                f"{local_batch_size} * dp_world_size {dp_world_size}"
            )
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_world_size})")
        if tokens.numel() < 2:
            raise ValueError("token stream is too short")
        self.tokens = tokens
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.global_batch_size, self.dp_rank, self.dp_world_size = (
            global_batch_size, dp_rank, dp_world_size
        )
        self.accum_steps = global_batch_size // per_micro_step
        self.infinite = infinite
        self._batch_idx = 0
        self._offsets = torch.arange(seq_len + 1)

    @property
    def num_batches(self) -> int | None:
        """Batches this rank yields before stopping (``None`` if infinite; no wrap-around)."""
        if self.infinite:
            return None
        samples = (self.tokens.numel() - 1) // self.seq_len
        return samples // self.global_batch_size * self.accum_steps

    def sample_ids(self, batch_idx: int) -> range:
        """Global sample indices held by this rank's ``batch_idx``-th batch."""
        step, micro = divmod(batch_idx, self.accum_steps)
        start = (step * self.global_batch_size
                 + (micro * self.dp_world_size + self.dp_rank) * self.local_batch_size)
        return range(start, start + self.local_batch_size)

    def batch(self, batch_idx: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This rank's ``batch_idx``-th batch (pure function of ``batch_idx``)."""
        ids = self.sample_ids(batch_idx)
        starts = torch.arange(ids.start, ids.stop) * self.seq_len
        rows = self.tokens[(starts[:, None] + self._offsets) % self.tokens.numel()]
        return {"input": rows[:, :-1].contiguous()}, rows[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        limit = self.num_batches
        while limit is None or self._batch_idx < limit:
            out = self.batch(self._batch_idx)
            self._batch_idx += 1
            yield out

    def state_dict(self) -> dict[str, Any]:
        """Position (batches yielded) plus the batch geometry it refers to."""
        return {
            "batch_idx": self._batch_idx,
            "accum_steps": self.accum_steps,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume; a step-aligned position may be restored under another DP degree."""
        if not state_dict:
            return
        for key in ("global_batch_size", "seq_len"):
            if int(state_dict[key]) != getattr(self, key):
                raise ValueError(f"cannot resume: {key} {state_dict[key]} != {getattr(self, key)}")
        step, micro = divmod(int(state_dict["batch_idx"]), int(state_dict["accum_steps"]))
        if micro and int(state_dict["accum_steps"]) != self.accum_steps:
            raise ValueError("cannot resume mid-step under a different accumulation split")
        self._batch_idx = step * self.accum_steps + micro


def build_global_batch_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: Any,
    job_config: Any,
    infinite: bool = True,
) -> GlobalBatchDataLoader:
    """TorchTitan ``build_dataloader_fn`` whose step ``n`` data is independent of DP degree."""
    if tokenizer is None:
        from torchtitan.components.tokenizer import build_hf_tokenizer

        tokenizer = build_hf_tokenizer(job_config)
    training = job_config.training
    return GlobalBatchDataLoader(
        token_stream(corpus_path(job_config), tokenizer),
        seq_len=training.seq_len,
        local_batch_size=training.local_batch_size,
        global_batch_size=training.global_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
    )
