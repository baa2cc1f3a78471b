"""Stand-ins for resolved fusekit calls on the CPU: ``call(name, fn)`` runs ``fn(*operands)`` (new
outputs, copied into given ones) or ``fn(*operands, out=outs)``; :func:`launcher` is a ``dispatch.execute.launch`` that runs them and
logs each call's name."""
from __future__ import annotations

import inspect
import types
from typing import Any, Callable


def call(name: str, fn: Callable[..., Any]) -> Any:
    return types.SimpleNamespace(name=name, fn=fn, into="out" in inspect.signature(fn).parameters)


def launcher(launched: list) -> Callable[..., tuple]:
    def launch(c: Any, operands: tuple, outs: tuple, alloc: bool) -> tuple:
        launched.append(c.name)
        if alloc:
            return tuple(c.fn(*operands))
        if c.into:
            c.fn(*operands, out=outs)
        else:  # a call that makes its outputs, given them (a replay's buffers): written into them
            for o, r in zip(outs, c.fn(*operands)):
                o.copy_(r)
        return outs

    return launch
