"""Integrations of tritoninfer's kernels into other libraries.

Each integration is a submodule that registers itself when imported, and only then imports the
library it integrates with (``import tritoninfer`` imports none of them):

- :mod:`tritoninfer.integrations.transformers`: ``attn_implementation="tritoninfer"`` in Hugging Face
  transformers, for ``generate()`` and the continuous-batching ``generate_batch()``.
"""
