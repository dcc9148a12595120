"""Imported before TorchTitan 0.3.0: torchao 0.18 (which 0.3.0 imports) registers two Enums as
pytree constants, which torch 2.14 logs as deprecated, twice per process: noise before every
one-line error. That message alone is dropped."""

from __future__ import annotations

import logging


def _keep(record: logging.LogRecord) -> bool:
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_keep)
