"""Validation of agent ids, which become file names on disk.

An agent id is chosen by the calling framework (CrewAI uses md5 hex keys,
AutoGen uses ``"alice_<uuid>"``, people use e-mail-like names), and each one
turns into ``<id>.safetensors`` inside the store directory. So the rule here is
a whitelist, not a blacklist: only characters that are harmless in a file name
on every platform we run on, nothing that could walk out of the directory
(``/``, ``\\``, ``..``), nothing invisible or look-alike (whitespace, NUL,
non-ASCII letters such as a Cyrillic ``а``), and none of the names Windows
treats as devices. Anything else is refused with a message that says what to
change, rather than being silently rewritten (two ids must never collide).
"""

from __future__ import annotations

from pathlib import Path

from kvshelf.errors import InvalidAgentId

MAX_AGENT_ID_LENGTH = 128

_FIRST_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_ALLOWED_CHARS = _FIRST_CHARS | frozenset("._:@-")
_ALLOWED_DESCRIPTION = "ASCII letters, digits and . _ : @ -"

# Device names that Windows reserves with or without an extension ("con.txt").
_RESERVED_NAMES = frozenset(
    ["con", "prn", "aux", "nul"] + [f"com{i}" for i in range(10)] + [f"lpt{i}" for i in range(10)]
)


def _shown(agent_id: str) -> str:
    """repr() of the id, shortened so a huge id cannot flood a log line."""
    text = repr(agent_id)
    return text if len(text) <= 60 else text[:57] + "..."


class AgentId(str):
    """An agent id that passed :func:`validate_agent_id`: constructing one validates it.

    Ids are checked once, where they enter kvshelf (the engine's public methods, the
    server, the adapters); code below that boundary takes ``AgentId`` and trusts it.
    """

    __slots__ = ()

    def __new__(cls, value: object) -> AgentId:
        if type(value) is cls:
            return value
        return super().__new__(cls, _checked(value))


def validate_agent_id(agent_id: object) -> AgentId:
    """Return ``agent_id`` as an :class:`AgentId` if it is safe, else raise InvalidAgentId.

    Accepted: 1 to 128 characters of ``[A-Za-z0-9._:@-]``, starting with a letter
    or digit, not ending with ``.``, without ``..``, and not a Windows device
    name such as ``CON`` or ``nul.x``.
    """
    return AgentId(agent_id)


def id_path(directory: Path, agent_id: str, suffix: str = "") -> Path:
    """``directory/<agent_id><suffix>``: where an id becomes a file name in storage.

    Storage checks ids here and nowhere else (records, lock files, shared-prefix
    markers all name their files through this), so a bad id raises InvalidAgentId
    before any disk access. An ``AgentId`` passes through unchecked; a plain str is
    checked, and only its validated value (never a subclass's ``__str__``) is used.
    """
    return directory / (AgentId(agent_id) + suffix)


def _checked(agent_id: object) -> str:
    """The plain ``str`` value of ``agent_id`` if it is a safe id, else raise InvalidAgentId."""
    if not isinstance(agent_id, str):
        raise InvalidAgentId(f"agent id must be a str, not {type(agent_id).__name__}")
    # Work on the plain str value: a str subclass could override __str__ or __iter__.
    agent_id = str.__str__(agent_id)
    if not agent_id:
        raise InvalidAgentId("agent id must not be empty")
    if len(agent_id) > MAX_AGENT_ID_LENGTH:
        raise InvalidAgentId(
            f"agent id is {len(agent_id)} characters long; the limit is "
            f"{MAX_AGENT_ID_LENGTH} (hash longer names, e.g. with hashlib.md5)"
        )
    for position, char in enumerate(agent_id):
        if char not in _ALLOWED_CHARS:
            kind = "non-ASCII character" if ord(char) > 127 else "character"
            raise InvalidAgentId(
                f"agent id {_shown(agent_id)} contains the {kind} {char!r} at position "
                f"{position}; only {_ALLOWED_DESCRIPTION} are allowed"
            )
    if agent_id[0] not in _FIRST_CHARS:
        raise InvalidAgentId(f"agent id {_shown(agent_id)} must start with an ASCII letter or digit")
    if ".." in agent_id:
        raise InvalidAgentId(f"agent id {_shown(agent_id)} must not contain '..'")
    if agent_id.endswith("."):
        raise InvalidAgentId(f"agent id {_shown(agent_id)} must not end with '.'")
    if agent_id.split(".", 1)[0].lower() in _RESERVED_NAMES:
        raise InvalidAgentId(
            f"agent id {_shown(agent_id)} is a reserved device name on Windows; "
            "add a prefix or suffix (e.g. 'agent-con')"
        )
    return agent_id


def is_valid_agent_id(agent_id: object) -> bool:
    """True when :func:`validate_agent_id` would accept ``agent_id``."""
    try:
        validate_agent_id(agent_id)
    except InvalidAgentId:
        return False
    return True
