"""Helpers of the 0.3.0 tests: ``kimi_adamw``, a user's own config module (``--module
tests_v0_3.support.kimi_adamw``)."""
