"""cupy-paged-attn: paged decode and prefill attention with an additive bias, compiled at run time by CuPy
(NVRTC).

Takes PyTorch, JAX and CuPy CUDA arrays (through DLPack) and NumPy arrays (on the CPU, through the float64
reference), and answers in the caller's own type.
"""

from . import planning, reference, tuning
from .bias import (
    RaggedBias,
    RelativePositionBias,
    alibi_slopes,
    t5_bucket_table,
    t5_position_bias,
    t5_relative_position_bucket,
)
from .cache import reshape_and_cache
from .decode import DecodePlan, paged_attention
from .prefill import paged_prefill_attention

__all__ = [
    "DecodePlan",
    "RaggedBias",
    "RelativePositionBias",
    "alibi_slopes",
    "paged_attention",
    "paged_prefill_attention",
    "planning",
    "reference",
    "reshape_and_cache",
    "t5_bucket_table",
    "t5_position_bias",
    "t5_relative_position_bucket",
    "tuning",
]
__version__ = "0.2.0"
