import pytest

from tests.support.parity import SINGLE_RANK, make_seed_checkpoint, run_job


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """Per model family: a seed checkpoint and the 1-rank losses from it, computed once.

    Made from ``<family>_debug_fsdp.toml``; every debug config of a family shares its model and
    training settings (scripts/make_configs.py), so any of them can be compared against it.
    """
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            config = f"{family}_debug_fsdp.toml"
            tmp = tmp_path_factory.mktemp(family)
            seed = make_seed_checkpoint(config, tmp)
            ref = run_job(config, 1, tmp / "ref", SINGLE_RANK, seed_checkpoint=seed)
            cache[family] = (seed, ref)
        return cache[family]

    return get
