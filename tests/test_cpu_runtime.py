"""One test per CPU/gloo patch in torchtitan_autoparallel.runtime (CP has its own file)."""

import types

import pytest
import torch

from torchtitan_autoparallel.runtime import cpu

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
    from torchtitan.models.moe import kernels
    from torchtitan.models.moe import utils as moe_utils

    # 2 ranks x 4 local experts; the stock default path launches a Triton kernel
    tokens = torch.tensor([4, 2, 1, 3, 1, 2, 3, 4], dtype=torch.int32)
    got = moe_utils.generate_permute_indices(tokens, 4, 2, 64, 8)
    want = kernels.generate_permute_indices(tokens, 4, 2, 64, 8, use_cpu=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    permuted = got[0]
    real = permuted[permuted >= 0]
    assert sorted(real.tolist()) == list(range(int(tokens.sum())))


def test_cuda_only_features_named():
    config = types.SimpleNamespace(
        model=types.SimpleNamespace(converters=["quantize.linear.float8"]),
        compile=types.SimpleNamespace(enable=True, backend="inductor"),
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
