"""The record of every attribute the CPU runtime layer replaced, so that it can be undone.

Invariant: every replacement goes through ``replace``; ``restore_all`` puts the originals
back in reverse order, so an attribute replaced twice ends up as it was before the first
replacement. A class attribute that the class only inherited is deleted again rather than
copied onto the class.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple

_MISSING = object()


class _Patch(NamedTuple):
    """One replaced attribute."""

    owner: Any  # module or class whose attribute was replaced
    name: str
    original: Any  # _MISSING when the owner did not define it itself


_patches: List[_Patch] = []


def replace(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name = value`` and remember the original for ``restore_all``."""
    if isinstance(owner, type):  # a class: restore only what it defined itself, not inherited
        original = owner.__dict__.get(name, _MISSING)
    else:
        original = getattr(owner, name, _MISSING)
    _patches.append(_Patch(owner, name, original))
    setattr(owner, name, value)


def restore_all() -> None:
    """Undo every ``replace`` since the last ``restore_all``, newest first."""
    for patch in reversed(_patches):
        if patch.original is _MISSING:
            delattr(patch.owner, patch.name)
        else:
            setattr(patch.owner, patch.name, patch.original)
    _patches.clear()
