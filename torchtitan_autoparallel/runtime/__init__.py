"""Run time: what runs inside a training process beside TorchTitan, for either release (HF
models' buffers and meta-device quirks, context parallel for attention written inline, per-step
metrics); the layer graph runs the same code when it measures a block on meta. The word means
this throughout the project (the CPU runtime of ``titan/*/cpu.py`` is the same: a training
process on CPU ranks); how auto handles a config key is ``titan/keys.py``'s vocabulary."""
