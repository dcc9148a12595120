"""Loss parity of TorchTitan's expert recipes on CPU/gloo against a 1-rank run (fp32, 5 steps)."""

from pathlib import Path

import pytest

from parity import SINGLE_RANK, assert_parity, make_seed_checkpoint, run_job

CASES = [
    # (config, world size)
    ("llama3_debug_fsdp.toml", 2),
    ("llama3_debug_tp.toml", 2),
    ("llama3_debug_fsdp_tp.toml", 4),
    ("llama3_debug_cp.toml", 2),
    ("deepseek_v3_debug_ep.toml", 2),
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Seed checkpoint and 1-rank losses per model family, computed once."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(config: str):
        family = config.split("_debug_")[0]
        if family not in cache:
            tmp = tmp_path_factory.mktemp(family)
            seed = make_seed_checkpoint(config, tmp)
            ref = run_job(config, 1, tmp / "ref", SINGLE_RANK, seed_checkpoint=seed)
            cache[family] = (seed, ref)
        return cache[family]

    return get


@pytest.mark.parametrize("config,ngpu", CASES, ids=[f"{c[:-5]}-{n}" for c, n in CASES])
def test_loss_parity(config, ngpu, references, tmp_path):
    seed, reference = references(config)
    result = run_job(config, ngpu, tmp_path, seed_checkpoint=seed)
    worst = assert_parity(reference, result)
    print(f"{config} world {ngpu}: max rel diff {worst:.2e} over {len(result.losses)} steps")
