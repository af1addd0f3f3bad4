"""Pure-PyTorch float32 semantics of every public tritoninfer function: the ground truth.

Written once, exactly as FlashInfer 0.5.3 behaves (see ``../shared/reference/flashinfer-api.md``),
and usable by anyone to check a kernel. Nothing here imports a kernel or a wrapper.

- ``attention``: single/batch decode and prefill (paged and ragged), masks, RoPE, ALiBi, soft cap,
  sinks, fp8 scales, base-2 LSE, ``merge_state*``.
- ``elementwise``: RoPE application, RMSNorm variants, gated activations.
- ``mla``: multi-head latent attention over a paged latent cache, and its cache append.
- ``page``: page-table helpers and ``append_paged_kv_cache``, ``packbits``.
- ``sparse``: block-sparse attention (BSR and variable blocks) as FlashInfer's per-block-row requests.
- ``sampling``: softmax, the top-k / top-p / min-p filters and renorms, and the exact
  distributions the sampling functions draw from.
"""

from .attention import *  # noqa: F401,F403
from .elementwise import *  # noqa: F401,F403
from .mla import *  # noqa: F401,F403
from .page import *  # noqa: F401,F403
from .sampling import *  # noqa: F401,F403
from .sparse import *  # noqa: F401,F403
