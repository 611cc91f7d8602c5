"""Integrations with other libraries (each imported on its own; none is a dependency)."""
