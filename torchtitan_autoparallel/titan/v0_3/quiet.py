"""Imported before TorchTitan 0.3.0: torchao 0.18 (which 0.3.0 imports) registers two Enums as
pytree constants, which torch 2.14 logs as deprecated, twice per process: noise before every
one-line error. That message alone is dropped, as is 0.3.0's warning about its own
checkpoint default. ``warnings_off`` holds back TorchTitan's warnings
while the planner builds configs and models of its own (defaults, the model on meta)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


def _keep(record: logging.LogRecord) -> bool:
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_keep)


def _not_default_noise(record: logging.LogRecord) -> bool:
    """TorchTitan 0.3.0's checkpoint config warns about its own default
    (``initial_load_model_only=True`` without an ``initial_load_path``) each time one is
    built: noise in every job's output, and inside error lines when stderr is captured."""
    return "initial_load_model_only=True has no effect" not in record.getMessage()


logging.getLogger().addFilter(_not_default_noise)  # TorchTitan's logger is the root logger


@contextlib.contextmanager
def warnings_off() -> Iterator[None]:
    """The root logger at ERROR inside the block."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)
