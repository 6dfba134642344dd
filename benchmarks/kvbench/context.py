"""What the sections share in one run: the settings, one engine, a scratch directory.

One model load serves every in-process section; agents that the TTFT section prefills
are kept (``records``) so the capacity section can copy their real blocks instead of
prefilling the same long prompts again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.settings import Settings


@dataclass
class BenchContext:
    settings: Settings
    model: str
    out_dir: Path
    work_dir: Path
    engine: Any = None  # kvshelf.runtime.engine.Engine, created on first use
    records: dict[int, str] = field(default_factory=dict)  # prompt tokens -> agent id with a record

    @property
    def cache_dir(self) -> Path:
        return self.work_dir / "agents"

    def get_engine(self) -> Any:
        if self.engine is None:
            from kvshelf.runtime.engine import Engine

            self.engine = Engine(model=self.model, cache_dir=self.cache_dir, progress=False)
            self.engine.chat(None, [{"role": "user", "content": "warm up"}], max_tokens=2)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
