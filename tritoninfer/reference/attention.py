"""Reference semantics (see package docstring)."""

__all__: list = []
