"""Fixtures for the service tests live in tests/conftest.py (the client tests share the server)."""
