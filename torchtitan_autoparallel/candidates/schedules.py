"""TorchTitan 0.2.2's pipeline schedules and the rules on stages per rank and micro-batches
each accepts. Imports nothing of the package."""

import functools

SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")
"""TorchTitan 0.2.2's pipeline schedules (``parallelism.pipeline_parallel_schedule``)."""
SINGLE_STAGE = ("1F1B", "GPipe")
"""Schedules with one stage per rank; the others need at least two (V schedules exactly 2)."""
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that split the backward into input and weight gradients: they cannot run
compiled blocks (torch.compile fuses the backward TorchTitan would split)."""
MOE_ONLY = ("DualPipeV",)
"""Offered to MoE models only (its point is hiding the expert all-to-all)."""
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Schedules whose two stages per rank form a V (first and last stage on rank 0)."""


def schedule_stages(schedule: str) -> tuple[int, ...]:
    """Stages per rank ``schedule`` runs: one (1F1B, GPipe), two (V schedules) or 2-4
    (interleaved)."""
    if schedule in SINGLE_STAGE:
        return (1,)
    if schedule in V_SCHEDULES:
        return (2,)
    return (2, 3, 4)


@functools.lru_cache(maxsize=1024)
def stage_options(schedule: str, pp: int, n_blocks: int) -> tuple[int, ...]:
    """Stages per rank ``schedule`` can run with ``pp`` ranks and ``n_blocks`` blocks (every
    stage holds at least one block)."""
    return tuple(v for v in schedule_stages(schedule) if pp * v <= n_blocks)


def microbatch_ok(schedule: str, pp: int, v: int, m: int) -> bool:
    """Whether TorchTitan 0.2.2 / PyTorch run ``schedule`` with ``m`` micro-batches: at least
    pp (fewer hangs TorchTitan's 1F1B), V schedules at least their 2 pp stages, interleaved
    ones a multiple of pp (PyTorch's rounds)."""
    if m < pp:
        return False
    if schedule in V_SCHEDULES:
        return m >= 2 * pp
    if schedule not in SINGLE_STAGE:
        return m % pp == 0
    return True
