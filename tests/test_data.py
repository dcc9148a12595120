"""Offline data: assets, tokenizer, DP-invariant global-batch loader, TorchTitan registry."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.config import JobConfig

from torchtitan_autoparallel.titan.v0_2 import data
from torchtitan_autoparallel.titan.v0_2.job import resolve_assets_path

SEQ_LEN = 16
G = 8
# (dp_world_size, local_batch_size) pairs for G = 8: accumulation steps 1, 2, 4, 8.
SPLITS = [(1, 8), (1, 4), (1, 1), (2, 4), (2, 2), (2, 1), (4, 2), (4, 1)]


def _job_config(local_bs: int = 2, global_bs: int = -1, seq_len: int = SEQ_LEN) -> JobConfig:
    job = JobConfig()
    job.model.hf_assets_path = str(data.DEFAULT_TOKENIZER)
    job.training.dataset = data.DATASET_NAME
    job.training.local_batch_size = local_bs
    job.training.global_batch_size = global_bs
    job.training.seq_len = seq_len
    return job


@pytest.fixture(scope="module")
def tokenizer():
    return build_hf_tokenizer(_job_config())


@pytest.fixture(scope="module")
def stream(tokenizer) -> torch.Tensor:
    return data.token_stream(data.DEFAULT_CORPUS, tokenizer)


def _reference(stream: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Samples [first, first+count) cut directly from the (repeated) stream."""
    reps = (first + count + 1) * SEQ_LEN // stream.numel() + 2
    flat = stream.repeat(reps)
    rows = [flat[j * SEQ_LEN : (j + 1) * SEQ_LEN + 1] for j in range(first, first + count)]
    return torch.stack(rows)


def _loaders(tokenizer, dp: int, lb: int) -> list[data.GlobalBatchDataLoader]:
    job = _job_config(lb, G)
    return [data.build_global_batch_dataloader(dp, r, tokenizer, job) for r in range(dp)]


def _step_rows(iters: list, accum: int) -> torch.Tensor:
    """Rows of one optimizer step, micro-step major then rank (= global sample order)."""
    rows = []
    for _ in range(accum):
        for it in iters:
            inputs, labels = next(it)
            assert inputs["input"].dtype == torch.long and labels.dtype == torch.long
            assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])
            rows.append(torch.cat([inputs["input"], labels[:, -1:]], dim=1))
    return torch.cat(rows)


@pytest.mark.parametrize("dp,lb", SPLITS)
def test_step_data_independent_of_dp_degree(tokenizer, stream, dp, lb):
    loaders = _loaders(tokenizer, dp, lb)
    accum = G // (dp * lb)
    assert all(dl.accum_steps == accum for dl in loaders)
    iters = [iter(dl) for dl in loaders]
    for step in range(3):
        rows = _step_rows(iters, accum)
        assert rows.shape == (G, SEQ_LEN + 1)
        assert torch.equal(rows, _reference(stream, step * G, G))


def test_wraps_cyclically_and_finite_mode():
    tokens = torch.arange(10)
    dl = data.GlobalBatchDataLoader(tokens, seq_len=4, local_batch_size=1, global_batch_size=1)
    batches = itertools.islice(dl, 4)
    got = [inp["input"][0].tolist() + lab[0, -1:].tolist() for inp, lab in batches]
    assert got == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, 0, 1, 2], [2, 3, 4, 5, 6]]
    finite = data.GlobalBatchDataLoader(tokens, 4, 1, 2, infinite=False)
    assert finite.num_batches == 2 and len(list(finite)) == 2  # 2 unwrapped samples, G=2


def test_rejects_indivisible_global_batch(tokenizer):
    with pytest.raises(ValueError, match="not a multiple"):
        data.build_global_batch_dataloader(2, 0, tokenizer, _job_config(3, 8))


def test_state_dict_round_trip(tokenizer):
    dl = data.build_global_batch_dataloader(2, 1, tokenizer, _job_config(2, G))
    it = iter(dl)
    for _ in range(5):
        next(it)
    state = dl.state_dict()
    expected = next(it)
    resumed = data.build_global_batch_dataloader(2, 1, tokenizer, _job_config(2, G))
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert torch.equal(got[0]["input"], expected[0]["input"])
    assert torch.equal(got[1], expected[1])
    fresh = next(iter(data.build_global_batch_dataloader(2, 1, tokenizer, _job_config(2, G))))
    assert not torch.equal(got[1], fresh[1])


def test_resume_at_step_boundary_under_other_dp_degree(tokenizer, stream):
    (dl,) = _loaders(tokenizer, 1, 4)  # accumulation 2
    it = iter(dl)
    for _ in range(2 * 3):  # three optimizer steps
        next(it)
    state = dl.state_dict()
    loaders = _loaders(tokenizer, 2, 1)  # accumulation 4: a different split
    for loader in loaders:
        loader.load_state_dict(state)
    rows = _step_rows([iter(d) for d in loaders], 4)
    assert torch.equal(rows, _reference(stream, 3 * G, G))
    with pytest.raises(ValueError, match="mid-step"):
        loaders[0].load_state_dict({**state, "batch_idx": 7})
    with pytest.raises(ValueError, match="global_batch_size"):
        loaders[0].load_state_dict({**state, "global_batch_size": 16})


def test_tokenizer_loads_from_assets(tokenizer, stream, monkeypatch, tmp_path):
    assert tokenizer.vocab_size == 2000 < 2048
    assert tokenizer.bos_id is not None and tokenizer.eos_id is not None
    assert tokenizer.bos_id != tokenizer.eos_id
    text = "Return the sum of a and b. Unicode too: naïve café — ok!"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.bos_id not in ids[1:-1] and tokenizer.eos_id not in ids[1:-1]
    assert tokenizer.decode(ids[1:-1]) == text
    assert tokenizer.encode(text) == ids[1:-1]  # no implicit BOS/EOS
    monkeypatch.chdir(tmp_path)  # outside the checkout: the package's assets are found
    job = _job_config()
    job.model.hf_assets_path = "./assets/tokenizer"  # the relative path the train configs use
    resolve_assets_path(job)
    assert build_hf_tokenizer(job).encode(text) == ids[1:-1]
    assert int(stream.max()) < 2000 and stream.numel() > 100_000
    assert int((stream == tokenizer.bos_id).sum()) == len(data.read_texts(data.DEFAULT_CORPUS))


def test_assets_are_small_and_well_formed():
    files = [data.DEFAULT_CORPUS, *sorted(data.DEFAULT_TOKENIZER.iterdir())]
    assert {f.name for f in files} >= {"corpus.jsonl", "tokenizer.json", "tokenizer_config.json"}
    assert sum(f.stat().st_size for f in files) <= 10 * 2**20
    lines = data.DEFAULT_CORPUS.read_text(encoding="utf-8").splitlines()
    docs = [json.loads(line) for line in lines]
    assert len(docs) > 1000 and all(set(d) == {"text"} and d["text"] for d in docs)
    assert len({d["text"] for d in docs}) == len(docs)


def test_make_assets_is_deterministic(tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_assets.py"
    for out in ("a", "b"):
        subprocess.run([sys.executable, str(script), "--out-dir", str(tmp_path / out)],
                       check=True, capture_output=True, timeout=120)
    for rel in ("data/corpus.jsonl", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"):
        a = (tmp_path / "a" / "assets" / rel).read_bytes()
        assert a and a == (tmp_path / "b" / "assets" / rel).read_bytes(), rel


def test_stock_torchtitan_loader_uses_registered_dataset(tokenizer):
    from torchtitan.hf_datasets.text_datasets import DATASETS, build_text_dataloader

    data.register_datasets()
    data.register_datasets()  # idempotent
    cfg = DATASETS[data.DATASET_NAME]
    assert cfg.path == str(data.DEFAULT_CORPUS) and data.DEFAULT_CORPUS.is_absolute()
    job = _job_config(local_bs=2, seq_len=32)
    dl = build_text_dataloader(dp_world_size=2, dp_rank=1, tokenizer=tokenizer, job_config=job)
    inputs, labels = next(iter(dl))
    assert inputs["input"].shape == labels.shape == (2, 32)
    assert int(inputs["input"][0, 0]) == tokenizer.bos_id  # a document start
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])
