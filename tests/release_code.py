"""One method of a vLLM release's real source, compiled alone, for the tests whose
subject is a few lines of a class that cannot be built on this machine (a builder
that needs CUDA, a config that needs a GPU model). Optionally only some of its
statements: those that assign given names, or test them."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

from vllm_v4_patches.sources import find_class, find_method, names_in


def release_method(
    root: Path, path: str, class_name: str, method: str, keep: set[str] | None = None
) -> Callable:
    """``class_name.method`` from ``root/path`` as a plain function of ``self``; with
    ``keep``, only its top-level statements that assign one of those names (``self.x``
    or a local) or, for an ``if``, read one. Decorators are dropped."""
    tree = ast.parse((root / path).read_text())
    function = find_method(find_class(tree, class_name), method)
    if keep is not None:
        function.body = [s for s in function.body if _touches(s, keep)]
        function.args.args = function.args.args[:1]
        function.args.defaults = []
        function.returns = None
    function.decorator_list = []
    module = ast.fix_missing_locations(ast.Module(body=[function], type_ignores=[]))
    namespace: dict = {}
    exec(compile(module, str(root / path), "exec"), namespace)
    return namespace[method]


def _touches(statement: ast.stmt, names: set[str]) -> bool:
    if isinstance(statement, ast.If):
        return bool(names_in(statement.test) & names)
    targets = statement.targets if isinstance(statement, ast.Assign) else []
    if isinstance(statement, ast.AnnAssign):
        targets = [statement.target]
    assigned = {t.attr if isinstance(t, ast.Attribute) else getattr(t, "id", "") for t in targets}
    return bool(assigned & names)
