"""Source readers for probes: the live vLLM, or an unpacked source tree.

A probe asks for a module's source by dotted name and gets text, or None when
the module does not exist in that vLLM. Reading never imports the module.
"""

from __future__ import annotations

import ast
import os
from importlib import util
from typing import Protocol


class SourceReader(Protocol):
    def read(self, module: str) -> str | None: ...


class InstalledSource:
    """The vLLM that this interpreter would import.

    Only the top-level package is located through the import system (locating a
    submodule with find_spec imports its parent packages, which fails while vLLM
    itself is still importing); submodules are files under it.
    """

    def read(self, module: str) -> str | None:
        top, _, rest = module.partition(".")
        try:
            spec = util.find_spec(top)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        if not rest:
            return _read_python(spec.origin)
        for root in spec.submodule_search_locations or ():
            found = TreeSource(os.path.dirname(root)).read(module)
            if found is not None:
                return found
        return None


def _read_python(path: str | None) -> str | None:
    if not path or not path.endswith(".py"):
        return None
    with open(path, encoding="utf-8") as handle:
        return handle.read()


class TreeSource:
    """An unpacked vLLM source tree: ``root`` holds the ``vllm/`` package."""

    def __init__(self, root: str) -> None:
        self.root = root

    def read(self, module: str) -> str | None:
        base = os.path.join(self.root, *module.split("."))
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as handle:
                    return handle.read()
        return None


# AST helpers shared by probes.


def find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def find_method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def read_method(
    source: SourceReader, module: str, cls_name: str, name: str
) -> ast.FunctionDef | None:
    """``cls_name.name`` in ``module``'s source, or None where any of them is missing."""
    text = source.read(module)
    cls = find_class(ast.parse(text), cls_name) if text else None
    return find_method(cls, name) if cls else None


def dotted(node: ast.AST) -> str:
    """``self.quant_method.embedding`` for an attribute chain, else ''."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def names_in(node: ast.AST) -> set[str]:
    """Every bare name and attribute name used inside ``node``."""
    found: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
    return found
