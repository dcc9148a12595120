"""The job-config sections a model's args read besides TorchTitan's own (a user's
``job.custom_config_module``, e.g. TorchTitan's HF backend and its ``[hf_transformers]``), and
the identity of the model config they name (the HF ``config.json``) for plan fingerprints.

The layer graph gets a default job config with these sections set (0.2.2's
``titan.v0_2.model.graph_job_config``), as TorchTitan's trainer hands ``update_from_config`` the
real one; a plan records them so that ``explain`` / ``diff`` / ``show`` rebuild the same graph
from the plan alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

from ..errors import UserError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A custom config module and the values of the sections it adds."""

    module: str = ""
    sections: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        """Stable text of the whole record (cache keys)."""
        import json

        return json.dumps([self.module, self.sections], sort_keys=True, default=str)


def _known_sections() -> set[str]:
    from torchtitan.config import JobConfig

    from .config import JobConfig as Extension

    return ({f.name for f in dataclasses.fields(JobConfig)}
            | {f.name for f in dataclasses.fields(Extension)})


def model_config_of(job_config: Any) -> ModelConfig:
    """The sections of ``job_config`` that its ``job.custom_config_module`` adds (neither
    TorchTitan's nor the project's), as plain data (a job that records its own
    ``model_config`` gives that)."""
    given = getattr(job_config, "model_config", None)
    if isinstance(given, ModelConfig):
        return given
    module = getattr(getattr(job_config, "job", None), "custom_config_module", "") or ""
    if not module or not dataclasses.is_dataclass(job_config):
        return ModelConfig()  # sections come only from a custom config module
    known = _known_sections()
    sections = {}
    for f in dataclasses.fields(job_config):
        if f.name not in known:
            value = getattr(job_config, f.name)
            sections[f.name] = (dataclasses.asdict(value) if dataclasses.is_dataclass(value)
                                else value)
    return ModelConfig(module if sections else "", sections)


def hf_config_file(model: str, key: str = "hf_transformers.model") -> str:
    """The ``config.json`` that ``key`` (``model``) names: a local folder's, a local file, or
    a Hub id's (from the local Hugging Face cache, or downloaded)."""
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if os.path.isfile(path):
            _check_json(path, key, model)
            return path
        raise UserError(f"{key} = {model!r} has no config.json: put the model's "
                        "Hugging Face config.json in that folder")
    if os.path.isfile(model):
        _check_json(model, key, model)
        return model
    try:
        from transformers.utils import cached_file

        path = cached_file(model, "config.json")
    except Exception as exc:  # offline, unknown id, gated repo
        from ..errors import shown

        raise UserError(f"{key} = {model!r}: no config.json found "
                        f"({shown(exc, 160)}); name a local folder holding config.json or a "
                        "Hugging Face model id") from None
    if not path:
        raise UserError(f"{key} = {model!r}: no config.json found")
    _check_json(str(path), key, model)
    return str(path)


def _check_json(path: str, key: str, model: str) -> None:
    """One line when the ``config.json`` at ``path`` is not a JSON object (Hugging Face's
    reader raises with a traceback)."""
    import json

    from ..errors import read_input, shown

    try:
        data = json.loads(read_input(path, "config.json").decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{key} = {model!r}: {path} is not valid JSON ({shown(exc, 120)}); "
                        "fix it or name the model's Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise UserError(f"{key} = {model!r}: {path} holds a JSON {type(data).__name__}, not "
                        "an object; name the model's Hugging Face config.json")


def config_identity(model_config: ModelConfig) -> dict[str, Any]:
    """What identifies the model config the sections name (for the plan fingerprint): the
    sections, and the SHA-256 of the HF ``config.json`` (so editing it makes plans made from
    the old one refuse to replay). Empty for jobs without custom sections."""
    if not model_config.sections:
        return {}
    out: dict[str, Any] = {"module": model_config.module, "sections": model_config.sections}
    hf = model_config.sections.get("hf_transformers")
    if isinstance(hf, dict):
        if not hf.get("model"):
            raise UserError("hf_transformers.model is empty: name a folder holding a Hugging "
                            "Face config.json (or a Hugging Face model id)")
        with open(hf_config_file(str(hf["model"])), "rb") as f:
            out["hf_config_sha256"] = hashlib.sha256(f.read()).hexdigest()[:16]
    return out


def model_config_from_fingerprint(fingerprint: dict[str, Any]) -> ModelConfig | None:
    """The ``ModelConfig`` a plan's fingerprint records (None for plans without one)."""
    record = fingerprint.get("model_config")
    if not record:
        return None
    return ModelConfig(record.get("module", ""), dict(record.get("sections", {})))
