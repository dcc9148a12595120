"""Upstream workarounds for TorchTitan 0.2.2: CPU/gloo (``cpu``, ``cpu_attention``), dry runs on
meta (``dry_run``), gradient norms across meshes (``grad_norm``) and under
``early_step_in_backward`` (``early_step``), MoE gradients under TP (``moe``), the pipeline
loss (``pipeline``)."""
