"""The test suite (pytest, CPU only). The folders mirror the layers; shared fixtures are in conftest.py."""
