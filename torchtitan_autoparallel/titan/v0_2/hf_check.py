"""Whether TorchTitan 0.2.2's HF backend can run a Hugging Face architecture at all, asked before
any rank starts (planning, ``run_train.sh``'s preflight, a recipe run through this project).

The backend's ``init_weights`` runs its own ``_init_weights`` (patched into transformers'
``PreTrainedModel``), which reads ``q_proj`` / ``k_proj`` / ``v_proj`` of every attention module
by name: an architecture with fused projections (Phi-3's ``qkv_proj``) stops there with a
traceback on every run, one rank included; modules it does not know (Mixtral's experts and
router) it leaves as allocated, and the run trains to NaN losses without a word. Here the same
``init_weights`` runs on a model built on meta (no values are written there; the in-place writes
are recorded): what it raises, or a parameter it never writes, is one line naming the
architecture.
"""

from __future__ import annotations

from typing import Any

from ...errors import UserError


def _written_storages(run: Any) -> set[int]:
    """The storages (of meta tensors too) that ``run()`` writes in place."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    written: set[int] = set()

    class Writes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            for i, arg in enumerate(func._schema.arguments):
                value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
                if arg.alias_info is not None and arg.alias_info.is_write and \
                        isinstance(value, torch.Tensor):
                    written.add(value.untyped_storage()._cdata)
            return func(*args, **kwargs)

    with torch.no_grad(), Writes():
        run()
    return written


def refusal(model: Any) -> str | None:
    """Why TorchTitan 0.2.2's HF backend cannot initialise ``model`` (built on meta: no values
    are written, the writes are recorded), or None."""
    try:
        written = _written_storages(lambda: model.init_weights(buffer_device=None))
    except Exception as exc:  # what the backend raises is the finding
        return f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:200].rstrip('.')}"
    left = [name for name, p in model.named_parameters()
            if p.untyped_storage()._cdata not in written]
    if left:
        return (f"leaves {left[0]} ({len(left)} parameters in all) unwritten, which would "
                "train from whatever memory held")
    return None


def check_hf_model(model: Any, hf_model: str) -> None:
    """UserError when TorchTitan 0.2.2's HF backend cannot run ``model`` (see ``refusal``)."""
    reason = refusal(model)
    if reason is None:
        return
    arch = type(getattr(model, "model", model)).__name__
    raise UserError(f"TorchTitan 0.2.2's HF backend cannot run {arch} (hf_transformers.model = "
                    f"{hf_model}): its init_weights, which every run goes through, {reason}; "
                    "this architecture cannot be trained with the backend")


def check_hf_spec(spec: Any, flavor: str, job_config: Any, hf_model: str) -> None:
    """``check_hf_model`` on train spec ``spec``'s ``flavor`` set up from ``job_config``, built
    on meta (its own build: the check initialises it)."""
    import copy

    args = copy.deepcopy(spec.model_args[flavor])
    args.update_from_config(job_config)
    check_hf_model(build_on_meta(lambda: spec.model_cls(args), hf_model), hf_model)


def check_hf_job(job_config: Any) -> None:
    """``check_hf_spec`` on the model of ``job_config`` (the HF backend's), as the planner
    sets it up."""
    from ...job.model_config import model_config_of
    from .model import graph_job_config
    from .registry import train_spec_of

    check_hf_spec(train_spec_of(job_config.model.name), job_config.model.flavor,
                  graph_job_config(model_config_of(job_config), job_config.training.seq_len),
                  str(job_config.hf_transformers.model))


def build_on_meta(build: Any, hf_model: str) -> Any:
    """``build()`` on meta; what stops the build (an HF class the backend's attention setting
    does not fit, e.g. Qwen2-MoE's: KeyError 'sdpa_torchtitan') as one line."""
    from ...errors import shown
    from ...graph.layer_graph import meta_model

    try:
        return meta_model(build)
    except Exception as exc:
        raise UserError(f"TorchTitan 0.2.2's HF backend cannot build {_architecture(hf_model)} "
                        f"(hf_transformers.model = {hf_model}): {type(exc).__name__}: "
                        f"{shown(exc, 200)}; this architecture cannot be trained with the "
                        "backend") from None


def _architecture(hf_model: str) -> str:
    """The first of ``architectures`` in ``hf_model``'s config.json ("the model" if none)."""
    import json

    from ...job.model_config import hf_config_file

    try:
        with open(hf_config_file(hf_model)) as f:
            return str(json.load(f)["architectures"][0])
    except Exception:  # a name for the message only
        return "the model"
