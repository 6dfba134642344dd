"""The KV layer: an agent's attention state in RAM as 4-bit blocks (``blocks``, coded by
a ``schemes`` entry), batched for decode (``batch``), shared between forks (``shared``),
and turned into a ``record`` for storage. Never touches the disk."""
