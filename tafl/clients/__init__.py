"""Clients: the REST client and batch scoring (later issues)."""
