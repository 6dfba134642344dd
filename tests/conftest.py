"""Shared fixtures. Importing kvshelf first preloads OpenBLAS before MLX."""

import kvshelf  # noqa: F401  (must precede any mlx import)
