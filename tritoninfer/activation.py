"""tritoninfer.activation: see README.md for what is implemented."""

__all__: list = []
