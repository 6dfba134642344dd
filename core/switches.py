"""Reading kvshelf's on/off environment switches (``KVSHELF_NO_OPENBLAS=1``, ...).

Every switch is read the same way, so a user who writes ``true`` or ``yes`` for one gets
what they meant for all of them.
"""

from __future__ import annotations

import os

ON = ("1", "true", "yes")


def env_on(name: str) -> bool:
    """Whether the environment variable ``name`` is set to 1, true or yes (any case)."""
    return os.environ.get(name, "").lower() in ON
