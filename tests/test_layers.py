"""The folders are layers, and no layer imports a higher one.

A newcomer draws the engine from the folder list: the model at the bottom, then the
KV caches in RAM, the storage on disk, the runtime that runs the model over the
caches, the serving layer that speaks OpenAI, and the framework adapters on top. This
test keeps that picture true: it reads every module's imports (without importing it)
and fails on an import that points upward.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. ``errors``, ``paths`` and ``switches`` are leaves every layer may use;
# the apps (``cli``, ``demo``, ``doctor``, and ``ctrl_c``, their Ctrl-C handling) sit on top of everything.
LAYERS = [
    "errors",
    "paths",
    "switches",
    "model",
    "kv",
    "storage",
    "structured",
    "runtime",
    "serving",
    "adapters",
    "apps",
]


def layer_of(module: str) -> str | None:
    """The layer of a dotted ``kvshelf`` module name; None for the package itself."""
    parts = module.split(".")
    if parts[0] != "kvshelf" or len(parts) == 1:
        return None
    top = parts[1]
    if top in ("cli", "demo", "doctor", "ctrl_c"):
        return "apps"
    return top if top in LAYERS else None


def modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "core").rglob("*.py"):
        rel = path.relative_to(ROOT / "core").with_suffix("")
        found[".".join(("kvshelf", *rel.parts)).removesuffix(".__init__")] = path
    for path in (ROOT / "adapters").rglob("*.py"):
        rel = path.relative_to(ROOT / "adapters").with_suffix("")
        found[".".join(("kvshelf", "adapters", *rel.parts)).removesuffix(".__init__")] = path
    return found


def imports_of(module: str, path: Path) -> set[str]:
    """Every kvshelf module this one imports, absolute or relative, anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in out if m.startswith("kvshelf.")}


def upward_imports() -> list[str]:
    bad = []
    for module, path in sorted(modules().items()):
        mine = layer_of(module)
        if mine is None:
            continue
        for target in sorted(imports_of(module, path)):
            theirs = layer_of(target)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    return bad


def test_every_module_belongs_to_a_layer() -> None:
    strays = [m for m in modules() if m != "kvshelf" and layer_of(m) is None]
    assert strays == [], f"modules outside the layers {LAYERS}: {strays}"


def test_no_layer_imports_a_higher_one() -> None:
    assert upward_imports() == []


def test_the_core_never_imports_a_framework() -> None:
    frameworks = ("autogen_core", "autogen_agentchat", "crewai", "langchain", "langchain_core", "langgraph")
    offenders = []
    for module, path in modules().items():
        if module.startswith("kvshelf.adapters"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{module}: {n}" for n in names if n.split(".")[0] in frameworks]
    assert offenders == []
