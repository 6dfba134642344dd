"""The runtime: the engine (a thin, typed public front), the scheduler that runs the model
over the caches it borrows, and the shelf that owns every agent's life in RAM and on disk
(residency, restoring, saving, retries, the byte budget, forks and erasure)."""
