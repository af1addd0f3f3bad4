"""tritoninfer: FlashInfer's Python API implemented in Triton.

Engines import from the same submodules as FlashInfer's (``tritoninfer.decode``,
``tritoninfer.prefill``, ``tritoninfer.cascade``, ``tritoninfer.page``, ``tritoninfer.rope``,
``tritoninfer.norm``, ``tritoninfer.activation``, ``tritoninfer.quantization``); the public names
are re-exported here as FlashInfer does at its top level.
"""

from . import activation, cascade, decode, norm, page, prefill, quantization, rope
from ._compat import install_as_flashinfer
from ._options import MaskMode, PosEncodingMode, TensorLayout
from .activation import *  # noqa: F401,F403
from .cascade import *  # noqa: F401,F403
from .decode import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .page import *  # noqa: F401,F403
from .prefill import *  # noqa: F401,F403
from .quantization import *  # noqa: F401,F403
from .rope import *  # noqa: F401,F403

__version__ = "0.1.0"

__all__ = (
    ["MaskMode", "PosEncodingMode", "TensorLayout", "__version__", "install_as_flashinfer"]
    + activation.__all__
    + cascade.__all__
    + decode.__all__
    + norm.__all__
    + page.__all__
    + prefill.__all__
    + quantization.__all__
    + rope.__all__
)
