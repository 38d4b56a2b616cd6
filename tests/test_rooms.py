"""The dependency rules of docs/architecture.md ("The rooms"), read from the source: which room imports which."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("catalog", "chunkstore", "restore", "maintenance", "kvc")
# The rooms each room may import (besides itself), as docs/architecture.md's table says.
ALLOWED = {
    "catalog": set(),
    "chunkstore": set(),
    "restore": {"catalog", "chunkstore"},
    "maintenance": {"catalog", "chunkstore", "restore"},
    "kvc": {"catalog", "chunkstore", "restore", "maintenance"},
}


def _rooms_imported(path: Path) -> set[str]:
    """The rooms a module names in an import statement (also inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in ROOMS)
    return found


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_only_the_rooms_it_may(room: str) -> None:
    wrong = {
        str(path.relative_to(ROOT)): sorted(bad)
        for path in sorted((ROOT / room).rglob("*.py"))
        if (bad := _rooms_imported(path) - ALLOWED[room] - {room})
    }
    assert wrong == {}
