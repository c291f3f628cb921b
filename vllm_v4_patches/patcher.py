"""Swapping attributes for one patch, recorded so that revert is exact.

Every change a patch makes goes through its :class:`Patcher`: wrapping a
function or method with a wrapt ``FunctionWrapper`` (or, for code that runs
inside ``torch.compile``, a plain function: see :func:`traceable_wrapper`), or
rebinding a copy that another module took with ``from x import y``. Applying
twice changes nothing the second time; revert restores the original objects, and refuses (loudly)
when something else has since been installed over one of ours. Two patches may
wrap one attribute (their records declare it shared): the later wrapper calls the
earlier, and either reverts alone, in any order.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_MARK = "_self_vllm_v4_patch_id"  # `_self_` keeps the attribute on the proxy itself
_MISSING = object()


@dataclass
class Swap:
    owner: Any  # a class or a module
    name: str
    original: Any  # the raw attribute found in owner.__dict__, or _MISSING
    replacement: Any


@dataclass(frozen=True)
class KnownCopy:
    """A module that binds a patched function under its own name."""

    module: str
    name: str


class RevertError(RuntimeError):
    pass


Restate = Callable[[str, str], None]  # (outcome, detail)


class Patcher:
    def __init__(self, patch_id: str, restate: Restate | None = None) -> None:
        self.patch_id = patch_id
        self._restate = restate
        self.swaps: list[Swap] = []
        self.known_copies: list[tuple[KnownCopy, Any]] = []  # (copy, replacement)
        self.armed: list[str] = []  # targets to wrap when their module is imported
        self.undos: list[tuple[str, Callable[[], None]]] = []  # (what, how to undo it)
        self.temporary: list[tuple[Any, str]] = []  # (owner, name) bound by swap_during
        self._reverted = False

    def wrap(
        self, owner: Any, name: str, wrapper: Callable[..., Any], *, traced: bool = False
    ) -> Any:
        """Wrap ``owner.name``; ``wrapper(wrapped, instance, args, kwargs)``.

        ``traced=True`` for a target that runs inside a model ``torch.compile``
        traces: the wrapper then installs as a plain function that Dynamo traces
        (a wrapt proxy it skips, tracing the original instead), and is always
        handed ``instance=None`` with the receiver first in ``args``."""
        import wrapt

        current = vars(owner).get(name, _MISSING)
        if getattr(current, _MARK, None) == self.patch_id:
            return current  # already ours: applying twice is a no-op
        if traced:
            replacement = traceable_wrapper(current, wrapper)
            setattr(owner, name, replacement)
        else:
            replacement = wrapt.wrap_function_wrapper(owner, name, wrapper)
        setattr(replacement, _MARK, self.patch_id)
        self.swaps.append(Swap(owner, name, current, replacement))
        return replacement

    def wrap_property(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> Any:
        """Wrap the getter of property ``owner.name``; same wrapper signature as ``wrap``."""
        import wrapt

        current = vars(owner)[name]
        if getattr(current, _MARK, None) == self.patch_id:
            return current
        if not isinstance(current, property):
            raise TypeError(f"{owner.__qualname__}.{name} is not a property")
        getter = wrapt.FunctionWrapper(current.fget, wrapper)
        replacement = _MarkedProperty(getter, current.fset, current.fdel, current.__doc__)
        replacement.patch_id = self.patch_id
        setattr(owner, name, replacement)
        self.swaps.append(Swap(owner, name, current, replacement))
        return replacement

    def wrap_when_imported(
        self,
        module_name: str,
        owner_path: str,
        name: str,
        wrapper: Callable[..., Any],
        *,
        getter: bool = False,
        traced: bool = False,
    ) -> str:
        """Wrap ``module.<owner_path>.<name>`` now if imported, else when it is.

        For targets in modules a process may never import (or cannot, such as
        vLLM's V2 runner without Triton): importing them just to patch would be
        wrong. ``getter=True`` wraps a property's getter; ``traced`` is ``wrap``'s.
        Returns "wrapped" or "armed".
        """

        def install(module: Any) -> None:
            owner = module
            for part in owner_path.split(".") if owner_path else ():
                owner = getattr(owner, part)
            if getter:
                self.wrap_property(owner, name, wrapper)
            else:
                self.wrap(owner, name, wrapper, traced=traced)

        return self._when_imported(module_name, f"{owner_path}.{name}", install, "wrapped")

    def register_when_imported(
        self, module_name: str, what: str, register: Callable[[Any], Callable[[], None]]
    ) -> str:
        """Run ``register(module)`` now if imported, else when it is; the callable it
        returns undoes the registration on revert. For additions made through a
        target's own API (a registry entry) rather than by swapping an attribute."""

        def install(module: Any) -> None:
            self.undos.append((what, register(module)))

        return self._when_imported(module_name, what, install, "registered")

    def _when_imported(
        self, module_name: str, what: str, install: Callable[[Any], None], done: str
    ) -> str:
        import wrapt

        def install_unless_reverted(module: Any) -> None:
            if not self._reverted:
                install(module)

        if module_name in sys.modules:
            install_unless_reverted(sys.modules[module_name])
            return done
        self.armed.append(f"{module_name}:{what}")
        wrapt.register_post_import_hook(install_unless_reverted, module_name)
        return "armed"

    def rebind_copies(self, original: Any, replacement: Any, copies: tuple[KnownCopy, ...]) -> None:
        """Point known ``from x import y`` copies at the replacement, now or on import."""
        import wrapt

        for copy in copies:
            self.known_copies.append((copy, replacement))
            module = sys.modules.get(copy.module)
            if module is not None:
                self._rebind(module, copy.name, original, replacement)
            else:
                wrapt.register_post_import_hook(
                    lambda mod, c=copy: (
                        self._rebind(mod, c.name, original, replacement) if self.swaps else None
                    ),
                    copy.module,
                )

    def _rebind(self, module: Any, name: str, original: Any, replacement: Any) -> None:
        current = vars(module).get(name, _MISSING)
        if current is original:
            setattr(module, name, replacement)
        if current is original or current is replacement:
            # a module imported after the patch already bound the replacement;
            # recording it anyway lets revert hand it the original back
            self.swaps.append(Swap(module, name, original, replacement))

    def copies_audit(self) -> tuple[int, int, list[str]]:
        """(patched, imported, names of stale copies) over the known copies."""
        patched = imported = 0
        stale: list[str] = []
        for copy, replacement in self.known_copies:
            module = sys.modules.get(copy.module)
            if module is None:
                continue
            imported += 1
            if vars(module).get(copy.name, _MISSING) is replacement:
                patched += 1
            else:
                stale.append(f"{copy.module}.{copy.name}")
        return patched, imported, stale

    def revert(self) -> None:
        outer = {id(swap): self._outer_wrapper(swap) for swap in self.swaps}
        for swap in reversed(self.swaps):
            if outer[id(swap)] is _MISSING:
                raise RevertError(
                    f"{_label(swap)} was replaced after vllm_v4_patches.{self.patch_id} "
                    "patched it; not reverting over the newer object"
                )
        for swap in reversed(self.swaps):
            wrapper = outer[id(swap)]
            if wrapper is not None:
                # another patch of this overlay wrapped ours since: unlink ours from
                # the chain, its wrapper now calls what ours called
                wrapper.__wrapped__ = swap.original
            elif swap.original is _MISSING:
                delattr(swap.owner, swap.name)
            else:
                setattr(swap.owner, swap.name, _unwrapped(swap))
        for _, undo in reversed(self.undos):
            undo()
        self.swaps.clear()
        self.undos.clear()
        self.known_copies.clear()
        self._reverted = True  # hooks still pending must not install anything now

    @staticmethod
    def _outer_wrapper(swap: Swap) -> Any:
        """None where ``swap.replacement`` is still installed; the overlay wrapper
        installed over it where another patch wrapped the same attribute later;
        _MISSING where anything else replaced it."""
        current = vars(swap.owner).get(swap.name, _MISSING)
        if current is swap.replacement:
            return None
        while getattr(current, _MARK, None) is not None and not isinstance(current, property):
            inner = getattr(current, "__wrapped__", _MISSING)
            if inner is swap.replacement:
                return current
            current = inner
        return _MISSING

    @contextlib.contextmanager
    def swap_during(self, owner: Any, names: tuple[str, ...], replacement: Any) -> Iterator[None]:
        """Bind ``owner.<name>`` to ``replacement`` for the length of a block, for
        a name read only inside one call (a class a constructor instantiates).
        Recorded in ``temporary`` so that an audit sees every attribute touched."""
        originals = {name: getattr(owner, name) for name in names}
        self.temporary.extend((owner, name) for name in names)
        for name in names:
            setattr(owner, name, replacement)
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(owner, name, original)

    def restate(self, outcome: str, detail: str) -> None:
        """The patch's later word on its outcome in this process.

        Some facts exist only after apply: which model runner an engine builds is
        decided when its config is, so a patch whose targets sit idle under the
        other runner says so here. Its changes stay installed; the process's
        status (and its status file) shows the new outcome.
        """
        if self._restate is not None and not self._reverted:
            self._restate(outcome, detail)

    @property
    def active(self) -> bool:
        return bool(self.swaps or self.undos) or (bool(self.armed) and not self._reverted)


class _MarkedProperty(property):
    """A property that can carry the mark of the patch that installed it."""

    patch_id: str | None = None

    def __getattr__(self, name: str) -> Any:
        if name == _MARK:
            return self.patch_id
        raise AttributeError(name)


def traceable_wrapper(function: Any, wrapper: Callable[..., Any]) -> Any:
    """``function`` wrapped by ``wrapper`` as a plain Python function.

    Dynamo takes a wrapt proxy for the function it proxies (the proxy forwards
    ``__class__`` and ``__code__``) and traces the original, so a wrapt wrapper on
    code inside a compiled model is silently skipped there. A plain function is
    traced like any other. It calls whatever its ``__wrapped__`` holds at call time,
    so that revert can unlink a patch beneath it as it does under wrapt.
    """
    if not isinstance(function, types.FunctionType):
        raise TypeError(f"{function!r} is not a plain function; traced wrapping needs one")

    def replacement(*args: Any, **kwargs: Any) -> Any:
        return wrapper(replacement.__wrapped__, None, args, kwargs)

    functools.update_wrapper(replacement, function)
    return replacement


def _unwrapped(swap: Swap) -> Any:
    """What ``swap.replacement`` calls now: its original, unless a patch it wrapped
    was reverted since and unlinked itself (then what that patch had wrapped)."""
    replacement = swap.replacement
    if isinstance(replacement, property) or not hasattr(replacement, "__wrapped__"):
        return swap.original
    return replacement.__wrapped__


def _label(swap: Swap) -> str:
    owner = getattr(swap.owner, "__qualname__", None) or getattr(
        swap.owner, "__name__", repr(swap.owner)
    )
    return f"{owner}.{swap.name}"


def is_patched_by(obj: Any, patch_id: str) -> bool:
    """Whether ``obj`` is a wrapper installed by the given patch."""
    return getattr(obj, _MARK, None) == patch_id


def split_receiver(instance: Any, args: tuple) -> tuple[Any, tuple, tuple]:
    """(self, the call's other arguments, the prefix to call ``wrapped`` with).

    wrapt passes ``instance=None`` when a method is called through its class
    (``Class.method(obj, ...)``), with the object as the first argument.
    """
    if instance is None and args:
        return args[0], args[1:], args[:1]
    return instance, args, ()
