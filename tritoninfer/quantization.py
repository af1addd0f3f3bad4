"""tritoninfer.quantization: see README.md for what is implemented."""

__all__: list = []
