"""Command-line interface: a thin layer over ``ckptvault.Vault``.

``main`` is the ``ckptvault`` command (pyproject's [project.scripts]; ``python -m ckptvault``). Ctrl-C
in the first ~50 ms of a run, while Python loaded the CLI (cli/process.py and what it imports), ended
with the traceback of an import and exit -2 (cli49 #9): this module, which the command imports first,
loads nothing itself, and ``main`` imports the rest under its guard, so that an interruption at any
time ends as one later does: one line, exit 130 (143 for SIGTERM). Nothing is done at import: a program
that imports ckptvault (or this module) keeps its own SIGINT handling. (ckptvault/__init__.py loads
nothing either, not even typing: only the import system's own steps come before the guard.)
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        try:
            sys.unraisablehook = _interrupt_again
            from .process import main as run

            run()
        except KeyboardInterrupt as exc:  # before the command's own handlers took over, or after they ended
            _end_interrupted(exc)
        except RuntimeError as exc:
            # Python 3.11 wraps one raised in a class's __set_name__ (platform's uname_result, while typer
            # loads): "Error calling __set_name__ ...", the interruption as its cause
            if not isinstance(exc.__cause__, KeyboardInterrupt):
                raise
            _end_interrupted(exc.__cause__)
    finally:
        _forget_handled_interruptions()


def _end_interrupted(exc: KeyboardInterrupt) -> None:
    code = getattr(exc, "exit_code", 130)  # interruptions.Terminated: SIGTERM, 143
    sys.stderr.write("error: terminated (SIGTERM)\n" if code != 130 else "error: cancelled\n")
    sys.exit(code)


def _forget_handled_interruptions() -> None:
    """``python -m ckptvault`` interrupted by Ctrl-C ~0.1 s in said "error: cancelled" and then died of SIGINT
    (status -2, 5-11 runs in 70) when the KeyboardInterrupt had come out of code that ``exec`` or ``eval`` ran from a
    string, as dataclasses and namedtuple make their methods while the commands load: CPython notes every
    KeyboardInterrupt that leaves such code as "not handled" (a flag of the process, ``_Py_UnhandledKeyboardInterrupt``)
    even where it is caught later, and the ``-m`` way of running (``Py_RunMain``) ends with SIGINT, as for a
    KeyboardInterrupt left uncaught, on seeing it after the interpreter's finalisation. (A console script or ``-c``
    ends through ``Py_Exit`` on SystemExit, which does not look.) Every interruption is handled by now; the next
    string that CPython evaluates clears the flag first."""
    exec("")


def _interrupt_again(unraisable: sys.UnraisableHookArgs) -> None:
    """Ctrl-C's KeyboardInterrupt raised where Python cannot raise it, in a weakref callback of the import
    system's (a module lock's), an extension module's initialisation or a ``__del__``, was printed as "Exception
    ignored in: ..." with its traceback, and lost: the command went on. The signal is delivered again, a moment
    later from another thread (raised in this hook, it would be lost the same way), where the main thread is. The
    thread is started bare: threading's start() waits until it runs, and on a busy machine its 2 ms were over by
    then, so that the interruption came in that wait, in this hook, and was lost with "Exception ignored in
    sys.unraisablehook" and its traceback."""
    if unraisable.exc_type is KeyboardInterrupt:  # (Terminated, SIGTERM's, is left as it was: rarely seen)
        import _thread

        _thread.start_new_thread(_interrupt_main_soon, ())
    else:
        sys.__unraisablehook__(unraisable)


def _interrupt_main_soon() -> None:
    import _thread
    import time

    time.sleep(0.002)  # the main thread has left the hook
    _thread.interrupt_main()
