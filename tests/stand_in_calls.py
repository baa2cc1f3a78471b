"""Stand-ins for resolved fusekit calls on the CPU: ``call(name, fn)`` runs ``fn(*operands)`` (new
outputs) or ``fn(*operands, out=outs)``; :func:`launcher` is a ``dispatch.launch`` that runs them and
logs each call's name."""
from __future__ import annotations

import types
from typing import Any, Callable


def call(name: str, fn: Callable[..., Any]) -> Any:
    return types.SimpleNamespace(name=name, fn=fn)


def launcher(launched: list) -> Callable[..., tuple]:
    def launch(c: Any, operands: tuple, outs: tuple, alloc: bool) -> tuple:
        launched.append(c.name)
        if alloc:
            return tuple(c.fn(*operands))
        c.fn(*operands, out=outs)
        return outs

    return launch
