"""kvshelf: every LLM agent keeps its own persistent 4-bit KV cache.

Importing kvshelf first preloads OpenBLAS on Linux (see ``kvshelf.model.blas``) so that
MLX's CPU backend does not fall back to the slow reference BLAS.
"""

from kvshelf.model.blas import load_openblas

load_openblas()

__version__ = "0.1.0"
