"""One test per CPU/gloo patch in torchtitan_autoparallel.runtime (CP has its own file)."""

import types

import pytest
import torch

from torchtitan_autoparallel.titan.v0_2 import cpu

pytestmark = pytest.mark.skipif(not cpu.cpu_mode(), reason="CPU patches only apply without CUDA")


@pytest.fixture(scope="module", autouse=True)
def installed():
    assert cpu.install() is True


def test_device_is_cpu():
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils

    for module in (tt_utils, metrics, parallel_dims, dist_utils):
        assert module.device_type == "cpu", module.__name__
    assert tt_utils.device_module is cpu.cpu_device_module
    monitor = metrics.build_device_memory_monitor()
    assert monitor.device_capacity > 2**30
    stats = monitor.get_peak_stats()
    assert stats.max_reserved_gib > 0.01  # the process's peak RSS, at least tens of MB
    assert cpu.cpu_device_module.current_device() == 0


def test_peak_rss_tracks_allocation():
    module = cpu.cpu_device_module
    module.reset_peak_memory_stats()
    before = module.peak_rss_bytes()
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = module.peak_rss_bytes()
    del x
    assert after - before > 48 * 2**20


def test_histc_int64():
    idx = torch.tensor([0, 1, 1, 3, 3, 3], dtype=torch.int64)
    counts = torch.histc(idx, bins=4, min=0, max=4)
    assert counts.dtype == torch.int64  # as on CUDA: counts become split sizes
    assert counts.tolist() == [1, 2, 0, 3]
    floats = torch.histc(idx.float(), bins=4, min=0, max=4)
    assert torch.equal(counts.float(), floats)


def test_permute_indices_cpu():
    """The CPU path groups tokens by local expert, rank-major inside each expert, each group
    padded with -1 to the alignment (here 8); expected indices worked out by hand."""
    from torchtitan.models.moe import utils as moe_utils

    # 2 ranks x 4 local experts; the stock default path launches a Triton kernel.
    # tokens in arrival order: rank 0 E0 0-3, E1 4-5, E2 6, E3 7-9; rank 1 E0 10, E1 11-12,
    # E2 13-15, E3 16-19
    tokens = torch.tensor([4, 2, 1, 3, 1, 2, 3, 4], dtype=torch.int32)
    permuted, m_sizes, m_offsets = moe_utils.generate_permute_indices(tokens, 4, 2, 64, 8)
    pad = -1
    expected = ([0, 1, 2, 3, 10] + [pad] * 3 + [4, 5, 11, 12] + [pad] * 4
                + [6, 13, 14, 15] + [pad] * 4 + [7, 8, 9, 16, 17, 18, 19, pad])
    assert permuted.tolist() == expected + [pad] * (64 - len(expected))
    assert m_sizes.tolist() == [8, 8, 8, 8]
    assert m_offsets.tolist() == [8, 16, 24, 32]


def test_cuda_only_features_named():
    config = types.SimpleNamespace(
        model=types.SimpleNamespace(name="llama3", flavor="debugmodel",
                                    converters=["quantize.linear.float8"]),
        quantize=types.SimpleNamespace(linear=types.SimpleNamespace(
            float8=types.SimpleNamespace(emulate=False))),
        compile=types.SimpleNamespace(enable=True, backend="inductor"),
        profiling=types.SimpleNamespace(enable_profiling=False, enable_memory_snapshot=False),
        training=types.SimpleNamespace(enable_cpu_offload=False),
        checkpoint=types.SimpleNamespace(async_mode="disabled"),
        parallelism=types.SimpleNamespace(auto=True, tensor_parallel_degree=1),
    )
    problems = cpu.cuda_only_features(config)
    assert len(problems) == 2
    assert "float8" in problems[0] and "aot_eager" in problems[1]
    config.model.converters, config.compile.enable = [], False
    assert cpu.cuda_only_features(config) == []
    # compile with a backend that runs on CPU is allowed
    config.compile.enable = True
    for backend in ("aot_eager", "eager"):
        config.compile.backend = backend
        assert cpu.cuda_only_features(config) == []
