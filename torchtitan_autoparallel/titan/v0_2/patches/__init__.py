"""Upstream workarounds for TorchTitan 0.2.2 beyond the CPU shims (``cpu``, ``cpu_attention``
one level up): dry runs on meta (``dry_run``), gradient norms across meshes (``grad_norm``) and
under ``early_step_in_backward`` (``early_step``), MoE gradients under TP (``moe``), the pipeline
loss (``pipeline``)."""
