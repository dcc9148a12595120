"""Kimi K2.5's debug config with AdamW in place of its DistMuon (which keeps parameters in its
own sharded storage, CUDA only): TorchTitan 0.3.0's extension point, a config function of the
user's own module (``--module tests_v0_3.support.kimi_adamw --config
kimi_k2_5_debugmodel_adamw``)."""

from torchtitan.components.optimizer import default_adamw
from torchtitan.models.kimi_k2_7.config_registry import kimi_k2_5_debugmodel
from torchtitan.trainer import Trainer


def kimi_k2_5_debugmodel_adamw() -> Trainer.Config:
    config = kimi_k2_5_debugmodel()
    config.optimizer = default_adamw(lr=8e-4)
    return config
