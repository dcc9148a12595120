"""A test's worker on a few gloo ranks of this machine (both releases' suites; torch only):
``spawn(worker, out_dir)`` starts the ranks, each runs ``worker(rank, out_dir)`` inside an
initialised process group and writes what the test reads under ``out_dir``."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    """A TCP port free on this machine now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable[[int, str], None], out_dir: str | Path, world: int = 2) -> None:
    """``worker(rank, out_dir)`` on ``world`` gloo ranks (a module-level function: the ranks
    import it); returns once every rank has finished, raises where one failed."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(worker, free_port(), str(out_dir), world), nprocs=world, join=True)


def _rank(rank: int, worker: Callable[[int, str], None], port: int, out_dir: str,
          world: int) -> None:
    """One rank: the process group around ``worker``, then a barrier (every rank's output
    written) and an exit that skips gloo's thread teardown (which can abort a finished rank)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        worker(rank, out_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)
