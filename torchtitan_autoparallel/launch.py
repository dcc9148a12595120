"""A planned job at launch, for either TorchTitan release: the plan resolved once (plan file or
solve) and handed by rank 0 to every rank through torchrun's store. How the job TorchTitan runs is
made to follow it is the release's (``titan/v0_2/train.py``, ``titan/v0_3/train.py``)."""

from __future__ import annotations

import os
from typing import Any

from .errors import UserError, shown


def resolve_plan(job_config: Any, world: int) -> Any:
    """The job's plan: the plan file (validated against the job) or a fresh solve."""
    import json

    from torchtitan.tools.logging import logger

    from .job.inputs import fingerprint_diff, job_inputs
    from .job.request import plan_job
    from .plan.assembly import inputs_record
    from .plan.recost import recosted_file
    from .plan.schema import Plan, check_plan_for_job

    ap = job_config.autoparallel
    if not ap.plan_file:
        return plan_job(job_config, world)
    plan = Plan.load(ap.plan_file)
    inputs = job_inputs(job_config, world, dp=plan.mesh.dp)
    job_fp = inputs.fingerprint
    diff = fingerprint_diff(plan.fingerprint, job_fp)
    if diff:
        raise UserError(
            f"plan {ap.plan_file} was made for another job ({'; '.join(diff)}): plan this "
            "job again "
            "(python -m torchtitan_autoparallel plan with the same config and overrides, "
            "--out a new file), drop autoparallel.plan_file to plan at launch, or run the job "
            "the plan was made for")
    check_plan_for_job(plan, world, [(layer.fqn, layer.kind) for layer in inputs.graph.layers],
                       ap.plan_file)
    if plan.fingerprint.get("versions") != job_fp["versions"]:
        logger.warning(f"plan {ap.plan_file} was made with {plan.fingerprint.get('versions')}"
                       f", this job runs {job_fp['versions']}")
    plan, note = recosted_file(plan)  # the stored inputs checked by their rules first
    if plan.inputs is not None:
        diff = record_diff(plan.inputs, json.loads(json.dumps(inputs_record(inputs))))
        if diff:
            raise UserError(f"plan {ap.plan_file} stores planning inputs that are not the "
                            f"job's ({'; '.join(diff[:3])}); re-plan (drop "
                            "autoparallel.plan_file) or run the job the plan was made for")
    if note:
        logger.warning(f"plan {ap.plan_file}: {note}")
    return plan


def check_plan_outputs(settings: Any, planned: bool) -> None:
    """``autoparallel.save_plan`` is refused where no plan is made (``planned``: auto or a plan
    file); where one is, ``Plan.save`` checks the path once the plan is checked."""
    if settings.save_plan and not planned:
        raise UserError(f"autoparallel.save_plan = {shown(settings.save_plan)} without "
                        "parallelism.auto: TorchTitan's own recipe runs and no plan is made; "
                        "turn auto on (--parallelism.auto) or drop save_plan")


def record_diff(plan: Any, job: Any, prefix: str = "") -> list[str]:
    """Readable differences ``key: plan -> job`` between two stored-inputs records."""
    if isinstance(plan, dict) and isinstance(job, dict):
        return [line for key in sorted(set(plan) | set(job))
                for line in record_diff(plan.get(key), job.get(key), f"{prefix}{key}.")]
    if plan == job:
        return []
    return [f"{prefix.rstrip('.')}: plan {shown(plan, 60)} -> job {shown(job, 60)}"]


PLAN_KEY = "autoparallel/plan"


def plan_from_rank0(resolve: Any, time_limit_s: float, alone: bool = False) -> Any:
    """``resolve()`` on rank 0, its plan (or its UserError) handed to the other ranks through
    torchrun's store (see ``titan.v0_2.train.shared_plan``); every process resolves alone when
    ``alone``, in one process, or without torchrun's store."""
    import json
    from datetime import timedelta

    from .plan.schema import Plan

    if (alone or int(os.environ.get("WORLD_SIZE", "1")) == 1
            or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"):
        return resolve()
    import torch.distributed as dist

    timeout = timedelta(seconds=max(1800.0, 20 * time_limit_s))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    key = f"{PLAN_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            plan = resolve()
        except UserError as exc:
            store.set(key, json.dumps({"error": str(exc)}))
            raise
        store.set(key, plan.to_json())
        return plan
    data = json.loads(store.get(key))
    if "error" in data:
        raise UserError(data["error"])
    return Plan.from_dict(data, "received from rank 0")
