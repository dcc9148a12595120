"""One package per TorchTitan release: how a job is read, how its model is built on meta, and
how a Plan is applied with that release's helpers. The planning pipeline imports none of them
(``frontend.frontend()`` loads the installed release's)."""
