"""cupy-paged-attn: paged decode attention with an additive bias, compiled at run time by CuPy (NVRTC).

Takes PyTorch, JAX and CuPy CUDA arrays (through DLPack) and NumPy arrays (on the CPU, through the float64
reference), and answers in the caller's own type.
"""

from . import reference
from .cache import reshape_and_cache
from .decode import paged_attention

__all__ = ["paged_attention", "reference", "reshape_and_cache"]
__version__ = "0.1.0"
