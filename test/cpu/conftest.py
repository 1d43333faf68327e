"""The CPU worker tests use the shared fixtures of ``test/conftest.py``."""
