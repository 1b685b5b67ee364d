"""The kind suite (see conftest.py); a package so that its conftest does not clash with tests/conftest.py."""
