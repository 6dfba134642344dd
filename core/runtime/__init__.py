"""The runtime: the engine (the public front), the scheduler that runs the model over
every agent's cache, and what an agent's life in RAM and on disk costs (pool, saves)."""
