"""``autoparallel.metrics_file`` and ``autoparallel.measure_memory`` for either TorchTitan
release's Trainer (both have ``metrics_processor``, ``parallel_dims``, ``model_parts``,
``optimizers`` and ``gradient_accumulation_steps``): rank 0 appends one JSON line per step (loss,
grad norm and memory peaks on TorchTitan's log steps, step time and tokens/s on every step),
and step 2 runs under PyTorch's MemTracker when memory is measured."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from ..candidates.layout import GIB


def compiled_graphs() -> int:
    """Graphs torch.compile has produced in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def gathered(value: float) -> list[float]:
    """``value`` from every rank, by global rank (one rank: just it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    out: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def record_logged_metrics(trainer: Any, loss_of: Callable[[float], float] = float) -> None:
    """Keep what TorchTitan logs on its log steps (loss, grad norm, the step's memory peaks,
    read before its log resets them) in ``trainer._last_metrics`` for the metrics file;
    ``loss_of`` maps the logged loss to the real one (the last pipeline stage's under PP)."""
    trainer._last_metrics = {}
    log = trainer.metrics_processor.log

    def record(step: int, loss: float, max_loss: float, grad_norm: float, **kw: Any) -> Any:
        loss, max_loss = loss_of(float(loss)), loss_of(float(max_loss))
        peak = trainer.metrics_processor.device_memory_monitor.get_peak_stats()
        trainer._last_metrics = {
            "loss": loss,
            "grad_norm": float(grad_norm),
            "peak_memory_gib": peak.max_reserved_gib,
            # bytes held by tensors (torch.cuda.max_memory_allocated on GPUs)
            "peak_active_gib": peak.max_active_gib,
        }
        return log(step, loss, max_loss, grad_norm, **kw)

    trainer.metrics_processor.log = record


def recorded_step(trainer: Any, run_step: Callable[[Any], None], data_iterator: Any,
                  settings: Any, training: Any) -> None:
    """Run one training step (``run_step``, TorchTitan's ``train_step``), under MemTracker at
    step 2 when ``settings.measure_memory``; on rank 0 append its row to
    ``settings.metrics_file`` when set."""
    measured, by_rank = None, []
    start = time.perf_counter()
    if settings.measure_memory and trainer.step == 2:
        measured = measured_step(trainer, run_step, data_iterator)
        by_rank = gathered(measured["Total"])
    else:
        run_step(data_iterator)
    elapsed = time.perf_counter() - start
    path = settings.metrics_file
    if not path or int(os.environ.get("RANK", "0")) != 0:
        return
    dims = trainer.parallel_dims
    batch_degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
    tokens = training.seq_len * trainer.gradient_accumulation_steps * (
        training.local_batch_size * batch_degree)
    # loss, grad norm and memory exist on TorchTitan's log steps only (metrics.log_freq):
    # other steps' rows carry the step time alone, never a previous step's loss
    metrics, trainer._last_metrics = trainer._last_metrics, {}
    row = {"step": trainer.step, **metrics, "step_time_s": elapsed,
           "tokens_per_s": tokens / elapsed,
           # graphs torch.compile has produced in this process so far (0: nothing compiled)
           "compiled_graphs": compiled_graphs()}
    if measured is not None:
        row["measured_tensor_peak_gib"] = measured["Total"]
        row["measured_tensor_peak_by_kind_gib"] = measured
        # every rank's peak, by global rank (pp ranks differ under pipelining)
        row["measured_tensor_peak_by_rank_gib"] = by_rank
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def measured_step(trainer: Any, run_step: Callable[[Any], None], data_iterator: Any
                  ) -> dict[str, float]:
    """Run one step under MemTracker; this rank's peak tensor memory (GiB) by kind."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.nn.modules.module import register_module_forward_pre_hook

    tracker = MemTracker()
    # the container is not an Optimizer: hand MemTracker the torch optimizers inside
    tracker.track_external(*trainer.model_parts, *trainer.optimizers.optimizers)
    modules = tracker._mod_tracker

    def new_microbatch(module: Any, args: Any) -> None:
        # MemTracker refuses a module called twice from the top level: a root under gradient
        # accumulation or pipeline micro-batches, TorchTitan 0.3.0's output projection called
        # per loss chunk. That module's own stats restart with each call (the blocks' are kept
        # for backwards still to run); the global peak is kept. Registered before MemTracker's
        # own global hooks, so it runs first (the module is not among the parents yet).
        if module in tracker.memory_tracking and not modules.is_bw \
                and set(modules.parents) <= {"Global"}:
            del tracker.memory_tracking[module]

    handle = register_module_forward_pre_hook(new_microbatch)
    try:
        with tracker:
            run_step(data_iterator)
    finally:
        handle.remove()
    peak = max(tracker.get_tracker_snapshot("peak").values(), key=lambda d: d["Total"])
    return {str(getattr(k, "value", k)): v / GIB for k, v in peak.items()}
