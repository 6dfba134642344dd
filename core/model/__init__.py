"""The model layer: load an mlx-lm model (or convert the embedded GGUF), read its cache
geometry (``spec``) and its chat format (``template``). Knows nothing about caches."""
