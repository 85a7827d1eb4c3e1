"""The source lines of the notebook's functions that a launch sends to its child ranks.

cloudpickle sends a function defined in the notebook by value and names its code
`<dynamic-code>`, so a child's debugger (and traceback) could show no line of it. The notebook
has the lines (IPython keeps each cell's in linecache): `take` collects them, for the launched
function and the notebook's functions it calls, and `give`, in the child, names each code after
its notebook cell again and puts those lines in the child's linecache, as IPython does for a cell.

Here, on a rank's side, because the child runs `give` (ddip.rank.oneshot); the launch
(ddip.launch.oneshot) calls `take` in the notebook. Both halves read functions alike.
"""

from __future__ import annotations

import linecache
import types


def take(fn) -> dict[str, tuple[str, list[str]]]:
    """In the notebook: qualified name -> (its cell's file name, that cell's lines), for fn and
    the notebook's functions it refers to."""
    found = {}
    for f in _notebook_functions(fn):
        name = f.__code__.co_filename
        lines = linecache.getlines(name)
        if lines:
            found[f.__qualname__] = (name, lines)
    return found


def give(fn, sources: dict[str, tuple[str, list[str]]]) -> None:
    """In a child: each function of `sources` named after its notebook cell, whose lines its
    linecache now has (no modification time: checkcache() keeps them, as IPython's cells)."""
    for f in _notebook_functions(fn):
        source = sources.get(f.__qualname__)
        if source is None:
            continue
        name, lines = source
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
        f.__code__ = _named(f.__code__, name)


def _notebook_functions(fn) -> list:
    """fn and the functions of __main__ it refers to by global name, and theirs."""
    seen: dict[int, types.FunctionType] = {}
    todo = [fn]
    while todo:
        f = todo.pop()
        if not isinstance(f, types.FunctionType) or f.__module__ != "__main__" or id(f) in seen:
            continue
        seen[id(f)] = f
        todo += [f.__globals__.get(name) for name in _global_names(f.__code__)]
    return list(seen.values())


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _named(code: types.CodeType, name: str) -> types.CodeType:
    consts = tuple(_named(c, name) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=name, co_consts=consts)
