"""Serving: the BentoML service over model packages (later issues)."""
