"""Cells that need none of IPython's machinery, run without `run_cell` (the lean request path).

`run_cell` costs a rank most of a trivial request's CPU: it runs IPython's input transformers,
parses, splits the cell into one module per statement, compiles each, and wraps them in traps and
events, for every request, though `g.run("x = 1")` or a training step's cell needs none of it.
`PlainCells.run` serves a cell that IPython would run unchanged as plain Python, with no value to
display, doing what `run_cell(code, store_history=True)` does that a user can see, in its order:
the execution count (`Out[rank:n]` in the magics), `In`/`_i`/`_iN`, the cell's file name and its
lines for tracebacks (`Cell In[n], line l`), the builtins IPython adds (`get_ipython`), output kept
in the history, `pre_execute`/`post_execute` events, and the error through the shell's own
`run_code` (the same traceback, custom exception handlers, SystemExit's warning).

Which cells qualify is decided once per code string (cells repeat; a bounded cache): IPython's
own `transform_cell` leaves it unchanged (no `%magic`, `!cmd`, `x?`, no prompts or indentation to
strip), it compiles as a whole with the shell's flags (no top-level `await`, no `__future__`
import, nothing that only fails when compiled), and its last statement is not an expression (the
display hook, `Out`, `_` stay IPython's). Anything that would make IPython act differently sends a
cell back to `run_cell`: `pre_run_cell`/`post_run_cell` handlers, AST transformers (JupyterLab's
debugger's cell names use one), a silent run, logging, `ast_node_interactivity` other than
'last_expr', and, for a one-line cell, what IPython's prefilter looks up at run time (a magic of
the first word's name with automagic on, a macro or autocallable of that name, autocall on). A
change of the transformers or compiler flags empties the cache.

DDIP_LEAN=0 in a rank's environment turns the lean path off (every cell through `run_cell`).
"""

from __future__ import annotations

import ast
import hashlib
import linecache
import os
from types import CodeType

from IPython.core.autocall import IPyAutocall
from IPython.core.compilerop import CachingCompiler
from IPython.core.history import HistoryManager
from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell
from IPython.core.macro import Macro
from IPython.core.prefilter import _default_checkers
from IPython.core.splitinput import LineInfo
from traitlets import All, HasTraits

CACHE_SIZE = 512  # code strings whose decision (and compiled code) is kept
_TOP_LEVEL_AWAIT = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
_COROUTINE = 0x80  # inspect.CO_COROUTINE: top-level await made the module a coroutine
_PLACEHOLDER = "<ddip-plain-cell>"
_KEEPS_TRACEBACKS = (ast.Try, ast.With) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())  # the compiled code's file name until a run names it


def _mirrors_this_ipython() -> bool:
    """_execute takes the steps of IPython 9's run_cell_async, with its state (the shell's output
    tees, the history's exceptions, ExecutionInfo's transformed cell). An older IPython (8.x, the
    last for Python 3.9 and 3.10) keeps other state: there every cell takes run_cell."""
    import inspect

    return (callable(getattr(getattr(InteractiveShell, "_tee", None), "__wrapped__", None))
            and hasattr(InteractiveShell, "_format_exception_for_storage")
            and "transformed_cell" in inspect.signature(ExecutionInfo).parameters)


_MIRRORS = _mirrors_this_ipython()
_TEE = InteractiveShell._tee.__wrapped__ if _MIRRORS else None  # the generator under its @contextmanager
_TRAITLETS_STATE = ("_trait_values", "_trait_notifiers", "_trait_validators")  # a HasTraits' own, per instance


def enabled() -> bool:
    return _MIRRORS and os.environ.get("DDIP_LEAN", "1") != "0"


class _Cell:
    """A cell that qualifies: its code (IPython's transformed text: the raw one and a newline)
    compiled once; `first_word` for a one-line cell (what IPython's prefilter looks up). `raw`:
    the cell's text as first received, which every later run of it stores (In, `_iN`) in place of
    its own copy of the same text: a cell repeated a million times is kept once, not a million
    times."""

    __slots__ = ("raw", "text", "code", "nested", "forgettable", "first_word", "stored", "digest", "lines")

    def __init__(self, raw: str, text: str, code: CodeType, tree: ast.Module, first_word: str | None):
        self.raw = raw
        self.text = text
        self.code = code
        self.nested = any(type(c) is CodeType for c in code.co_consts)
        # Once it ran without an error, nothing reads its lines again: no code object of it
        # outlives it (no function, class, lambda or comprehension), and no exception it caught
        # (try, or a with's __exit__ such as pytest.raises) keeps a traceback through its frame.
        self.forgettable = not self.nested and not any(isinstance(n, _KEEPS_TRACEBACKS) for n in ast.walk(tree))
        self.first_word = first_word
        # What the history stores of each run (its texts without their trailing newlines), made
        # once: IPython's store_inputs strips a copy of its own for every run otherwise.
        self.stored = (text.rstrip("\n"), raw.rstrip("\n"))
        # What IPython's compiler caches for each run (its name's hash, its lines), made once.
        self.digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]
        self.lines = [line + "\n" for line in text.splitlines()]

    def named(self, name: str) -> CodeType:
        """The code under the file name IPython gives this run of the cell."""
        return _renamed(self.code, name) if self.nested else self.code.replace(co_filename=name)


def _renamed(code: CodeType, name: str) -> CodeType:
    consts = tuple(_renamed(c, name) if type(c) is CodeType else c for c in code.co_consts)
    return code.replace(co_filename=name, co_consts=consts)


# The shell's traits that the decisions and the steps read: watched (traitlets' observe), so a
# request reads none of them (a trait read costs as much as a dict lookup and a call).
_WATCHED = ("autoawait", "automagic", "autocall", "ast_node_interactivity", "ast_transformers",
            "input_transformers_post", "input_transformer_manager", "prefilter_manager", "history_manager",
            "builtin_trap", "display_trap", "magics_manager")


class PlainCells:
    """Runs the cells that qualify (see the module's doc) for one shell; `served` counts them."""

    def __init__(self, shell):
        self.shell = shell
        self.served = 0
        self._cells: dict[str, _Cell | None] = {}  # code -> its _Cell, or None: run_cell's
        self._signature = None
        self._read_traits()
        shell.observe(self._traits_changed, names=list(_WATCHED))
        # What IPython puts in place for each cell and takes away after it, the builtins it adds
        # (get_ipython, exit, quit) and its display hook, stay in place: a rank runs cells and
        # nothing else, and each cell's traps are then a counter (run_cell's too).
        shell.builtin_trap.__enter__()
        shell.display_trap.__enter__()

    def _traits_changed(self, change):
        self._read_traits()

    def _read_traits(self):
        shell = self.shell
        self._cells.clear()
        # Only IPython's defaults qualify: one-line cells are judged by what the prefilter looks up.
        self._config_plain = shell.ast_node_interactivity == "last_expr" and not shell.autocall
        self._autoawait, self._automagic = shell.autoawait, shell.automagic
        self._ast_transformers, self._post = shell.ast_transformers, shell.input_transformers_post
        self._transformers = shell.input_transformer_manager
        self._prefilter = shell.prefilter_manager
        self._history = shell.history_manager
        self._builtin_trap, self._display_trap = shell.builtin_trap, shell.display_trap
        self._line_magics = shell.magics_manager.magics["line"]
        history, compiler = self._history, shell.compile
        # What _execute may do without traitlets' setters and IPython's methods: where IPython's own
        # classes run (a subclass may do more) and the history writes no database.
        self._direct = (all(hasattr(o, a) for o in (shell, shell.displayhook, history) for a in _TRAITLETS_STATE)
                        and not history.enabled
                        and type(history).store_inputs is HistoryManager.store_inputs
                        and type(history).store_output is HistoryManager.store_output
                        and type(compiler).cache is CachingCompiler.cache
                        and type(compiler).get_code_name is CachingCompiler.get_code_name
                        and _writable_directly(shell, _SHELL_TRAITS)
                        and _writable_directly(shell.displayhook, _HOOK_TRAITS)
                        and _writable_directly(history, _HISTORY_TRAITS))

    def run(self, code: str, silent: bool = False) -> ExecutionResult | None:
        """What run_cell(code, store_history=True) returns, for a cell that qualifies; None for
        one that needs IPython's path (the caller runs it through run_cell)."""
        if silent or not self._shell_is_plain():
            return None
        cell = self._cells.get(code, False)
        if cell is False:
            cell = self._decide(code)
        if cell is None or (cell.first_word is not None and self._prefilter_acts(cell.first_word)):
            return None
        self.served += 1
        return self._execute(self.shell, cell.raw, cell)

    def _shell_is_plain(self) -> bool:
        """Nothing registered that run_cell would call or apply around a cell."""
        shell = self.shell
        callbacks = shell.events.callbacks
        if (callbacks["pre_run_cell"] or callbacks["post_run_cell"] or self._ast_transformers
                or not self._config_plain or shell.trio_runner is not None or shell.logger.log_active):
            return False
        manager = self._transformers
        signature = (shell.compile.flags, len(self._post), len(manager.cleanup_transforms),
                     len(manager.line_transforms), len(manager.token_transformers))
        if signature != self._signature:  # transformers or __future__ flags changed: decide again
            self._signature = signature
            self._cells.clear()
        return True

    def _decide(self, code: str) -> _Cell | None:
        cell = self._qualifying(code)
        if len(self._cells) >= CACHE_SIZE:
            del self._cells[next(iter(self._cells))]  # the oldest decision
        self._cells[code] = cell
        return cell

    def _qualifying(self, code: str) -> _Cell | None:
        shell = self.shell
        if not code or code.isspace():
            return None  # run_cell does nothing with it, execution count included
        try:
            text = shell.transform_cell(code)
        except Exception:
            return None
        if text != code and text != code + "\n":
            return None  # a magic, a shell command, help, a prompt or an indent IPython strips
        if "get_ipython().run_line_magic(" in text and "paste" in text:
            return None  # run_cell keeps such cells out of the history
        one_line = len(text.splitlines()) == 1
        if one_line and not self._default_prefilter(text):
            return None
        try:
            tree = ast.parse(text)
            if not tree.body or isinstance(tree.body[-1], ast.Expr):
                return None  # nothing to run, or a value for the display hook
            if any(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in tree.body):
                return None  # the shell's compiler keeps __future__ flags for later cells
            flags = shell.compile.flags | (_TOP_LEVEL_AWAIT if self._autoawait else 0)
            compiled = compile(tree, _PLACEHOLDER, "exec", flags, True)
        except (SyntaxError, ValueError, TypeError, OverflowError, MemoryError, RecursionError):
            return None  # run_cell reports it, after running the statements before it
        if compiled.co_flags & _COROUTINE:
            return None  # top-level await: IPython's runner
        return _Cell(code, text, compiled, tree, LineInfo(text.rstrip("\n")).ifun if one_line else None)

    def _default_prefilter(self, text: str) -> bool:
        """Only IPython's own prefilter checkers (whose run-time lookups _prefilter_acts makes)
        and no prefilter transformers."""
        manager = self._prefilter
        return (not any(t.enabled for t in manager.transformers)
                and all(type(c) in _default_checkers for c in manager.checkers if c.enabled)
                and not text.rstrip("\n").endswith("# PYTHON-MODE"))

    def _prefilter_acts(self, word: str) -> bool:
        """Whether IPython's prefilter could change this one-line cell now (what it looks up at
        run time: autocall, a macro or autocallable of that name, a magic of that name)."""
        obj = self.shell.user_ns.get(word)
        if isinstance(obj, (Macro, IPyAutocall)):
            return True
        return self._automagic and word in self._line_magics  # autocall is off (_config_plain)

    def _execute(self, shell, code: str, cell: _Cell) -> ExecutionResult:
        """run_cell_async's steps for a cell with no value to display, in its order."""
        text = cell.text
        result = ExecutionResult(ExecutionInfo(code, True, False, True, None, None, transformed_cell=text))
        history = self._history
        hook = shell.displayhook
        direct = self._direct and _unobserved(((shell, _SHELL_TRAITS), (history, _HISTORY_TRAITS),
                                               (hook, _HOOK_TRAITS)))
        # IPython's _tee (a cell's output kept in the history, as `%notebook` writes it) without
        # contextlib's wrapper: its generators entered and left by hand, which costs a rank a
        # fifth less per plain cell, and in a `finally`, so that no exception leaves one in place.
        tee_out, tee_err = _TEE(shell, "stdout"), _TEE(shell, "stderr")
        next(tee_out)
        try:
            next(tee_err)
            try:
                values = shell._trait_values  # the traits' values, where traitlets keeps them
                count = result.execution_count = (values["execution_count"] if direct and "execution_count" in values
                                                  else shell.execution_count)
                if direct:
                    values["execution_count"] = count + 1
                else:
                    shell.execution_count += 1
                shell.events.trigger("pre_execute")
                if direct:
                    _store_inputs(shell, history, count, *cell.stored)
                else:
                    history.store_inputs(count, *cell.stored)
                with self._builtin_trap:
                    if direct:  # CachingCompiler.cache, with the cell's hash and lines made once
                        name = f"<ipython-input-{count}-{cell.digest}>"
                        shell.compile._filename_map[name] = count
                        linecache.cache[name] = (len(text), None, cell.lines, name)
                    else:
                        name = shell.compile.cache(text, count, raw_code=code)
                    with self._display_trap:
                        if direct:
                            hook._trait_values["exec_result"] = result
                            failed = _drive(shell.run_code(cell.named(name), result))
                            values["last_execution_succeeded"], values["last_execution_result"] = not failed, result
                            hook._trait_values["exec_result"] = None
                        else:
                            hook.exec_result = result
                            failed = _drive(shell.run_code(cell.named(name), result))
                            shell.last_execution_succeeded, shell.last_execution_result = not failed, result
                            hook.exec_result = None
                if not direct or history._trait_values.get("db_log_output", True):
                    history.store_output(count)  # in a rank (no database), it has nothing to store
                if result.error_in_exec is not None:
                    history.exceptions[count] = shell._format_exception_for_storage(result.error_in_exec)
                elif cell.forgettable:  # its lines, which IPython keeps for good, one copy per run
                    linecache.cache.pop(name, None)
                    shell.compile._filename_map.pop(name, None)
            finally:
                shell.events.trigger("post_execute")
        finally:
            for tee in (tee_err, tee_out):  # each entered puts back the write it replaced, as `with` would
                if tee.gi_suspended:
                    next(tee, None)
        return result


# The traits a run sets, by the object that has them. Where nothing observes or validates them
# (IPython itself does not), their new values are written straight into the object's values:
# traitlets' setter (validation, the change event, the search for observers and magic methods),
# nine times per cell, cost a rank more than the rest of the cell's bookkeeping.
_SHELL_TRAITS = (All, "execution_count", "last_execution_succeeded", "last_execution_result")
_HOOK_TRAITS = (All, "exec_result")
_HISTORY_TRAITS = (All, "_i", "_ii", "_iii", "_i00")


def _unobserved(objects) -> bool:
    """Whether setting the traits of each (obj, names) runs nothing (no observer of them or of every
    trait, no cross-validator): then they are written directly. One call of plain loops, for every
    plain cell: a call per object, each with its generators, cost a rank a tenth of the cell."""
    for obj, names in objects:
        notifiers, validators = obj._trait_notifiers, obj._trait_validators
        for name in names:
            handlers = notifiers.get(name)
            if handlers:
                for registered in handlers.values():
                    if registered:
                        return False
            if name in validators:
                return False
    return True


def _writable_directly(obj: HasTraits, names) -> bool:
    """Whether these traits have no magic methods (`_x_changed`, `_x_validate`) nor read-only flag:
    what a direct write would skip that _unobserved does not look at. Checked once."""
    traits = obj.traits()
    return all(name in traits and not traits[name].read_only and not hasattr(type(obj), f"_{name}_changed")
               and not hasattr(type(obj), f"_{name}_validate") for name in names if name is not All)


def _store_inputs(shell, history, count: int, parsed: str, raw: str) -> None:
    """HistoryManager.store_inputs for a history that writes no database (a rank's), the values of
    its `_i` traits written directly (_SHELL_TRAITS' reason). A plain cell is never `exit` or
    `quit`, which it leaves out."""
    values = history._trait_values
    try:  # the values themselves, as the writes below; a trait never read yet has none stored
        parsed_hist, raw_hist, i00, i, ii = (values["input_hist_parsed"], values["input_hist_raw"],
                                             values["_i00"], values["_i"], values["_ii"])
    except KeyError:
        parsed_hist, raw_hist, i00, i, ii = (history.input_hist_parsed, history.input_hist_raw,
                                             history._i00, history._i, history._ii)
    parsed_hist.append(parsed)
    raw_hist.append(raw)
    values["_iii"], values["_ii"], values["_i"], values["_i00"] = ii, i, i00, raw
    names = {"_i": i00, "_ii": i, "_iii": ii, f"_i{count}": raw}
    shell.user_ns.update(names)
    shell.user_ns_hidden.update(names)  # push(..., interactive=False): not listed by %who


def _drive(coro):
    """Runs a coroutine that never awaits (run_code without top-level await) to its end, as
    IPython's pseudo-sync runner does."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError(f"{coro!r} awaited: it needs an event loop")  # not reached: awaits go to run_cell

