"""Whether a worker's script imports torch, read from its source: then a fork server that imports it helps.

The script is parsed, not run; so are the modules it imports from its own directory tree (its package,
``from model import Net``...), up to :data:`MAX_FILES` files. Any ``import torch...`` / ``from torch...``
statement counts (or ``import ftrun``: its worker API imports torch), wherever it is: a function that
imports torch will run, or the import would not be there. A script that reaches torch only through an installed package of its own is not recognised: its workers
start as new processes, as without a fork server.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

MAX_FILES = 200
"""Most source files read for one script."""
TORCH = ("torch", "ftrun")
"""Packages whose import means torch (ftrun's worker API imports it)."""


def script_imports_torch(script: str) -> bool:
    """Whether the workers' script (a path, relative to the working directory) imports torch."""
    path = Path(os.getcwd(), script)
    return imports_torch(path, path.resolve().parent)


def imports_torch(entry: Path, root: Path) -> bool:
    """Whether ``entry`` or a module it imports from under ``root`` (its sys.path[0]) imports torch."""
    todo, seen = [entry], set()
    while todo and len(seen) < MAX_FILES:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            tree = ast.parse(path.read_bytes(), str(path))
        except (OSError, SyntaxError, ValueError):
            continue
        for base, name in _imported(tree, path, root):
            if base == root and name.split(".")[0] in TORCH:
                return True
            todo.extend(_sources(base, name))
    return False


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
        if (package / "__init__.py").is_file():
            yield package / "__init__.py"
        elif (directory / f"{part}.py").is_file():
            yield directory / f"{part}.py"
            return
        elif not package.is_dir():  # not under base (an installed module, or a name imported from a module)
            return
        directory = package
