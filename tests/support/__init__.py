"""Helpers the tests share: the parity harness (``parity``), the settings harness, and the
models and adapters jobs bring through ``experimental.custom_import`` (``tests.support.<name>``)."""
