"""The storage layer: agent ids that are safe file names, verified records on disk
(``records``), shared prefixes stored once (``prefixes``), and the lock that lets only
one server own a store (``exclusive``). Knows records, not models or caches."""
