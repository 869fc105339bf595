"""Integrations with other libraries (optional dependencies, imported lazily)."""
