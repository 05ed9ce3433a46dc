"""Which of torch and ftrun a worker's script imports, read from its source: a fork server that imports them helps.

The script is parsed, not run; so are the modules it imports from its own directory tree (its package,
``from model import Net``...), up to :data:`MAX_FILES` files. Any ``import torch...`` / ``from torch...``
statement counts (and ``import ftrun``: its worker API imports torch), wherever it is: a function that
imports torch will run, or the import would not be there. A script that reaches torch only through an installed package of its own is not recognised: its workers
start as new processes, as without a fork server.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

from ftrun.paths import is_dir, is_file

MAX_FILES = 200
"""Most source files read for one script."""
PACKAGES = frozenset({"torch", "ftrun"})
"""The installed packages looked for (either means torch: ftrun's worker API imports it)."""


def script_imports(script: str) -> frozenset[str]:
    """Which of :data:`PACKAGES` the workers' script (a path, relative to the working directory) imports."""
    path = Path(os.getcwd(), script)
    return imported_packages(path, path.resolve().parent)


def imported_packages(entry: Path, root: Path) -> frozenset[str]:
    """Which of :data:`PACKAGES` ``entry`` or a module it imports from under ``root`` (its sys.path[0]) imports."""
    todo, seen, found = [entry], set(), set()
    while todo and len(seen) < MAX_FILES and found != PACKAGES:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            tree = ast.parse(path.read_bytes(), str(path))
        except (OSError, SyntaxError, ValueError):
            continue
        for base, name in _imported(tree, path, root):
            if base == root and name.split(".")[0] in PACKAGES:
                found.add(name.split(".")[0])
            else:
                todo.extend(_sources(base, name))
    return frozenset(found)


def _imported(tree: ast.AST, path: Path, root: Path) -> Iterator[tuple[Path, str]]:
    """(directory the name is relative to, dotted name) for every module an import statement names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield root, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = root if node.level == 0 else path.parents[node.level - 1]
            module = node.module or ""
            if module:
                yield base, module
            for alias in node.names:
                yield base, f"{module}.{alias.name}" if module else alias.name


def _sources(base: Path, name: str) -> Iterator[Path]:
    """The files under ``base`` that importing ``name`` would run: each package's __init__ and the module."""
    directory = base
    for part in name.split("."):
        package = directory / part
        if is_file(package / "__init__.py"):
            yield package / "__init__.py"
        elif is_file(directory / f"{part}.py"):
            yield directory / f"{part}.py"
            return
        elif not is_dir(package):  # not under base (an installed module, or a name imported from a module)
            return
        directory = package
