"""The test suite of the TorchTitan 0.3.0 front-end (run by scripts/test_v0_3.sh in a venv of
its own); ``tests_v0_3.support`` holds its helper modules."""
