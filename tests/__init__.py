"""The test suite of the 0.2.2 front-end; ``tests.support`` holds its helper modules."""
