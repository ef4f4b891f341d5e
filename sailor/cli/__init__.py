"""The `sailor` command line: a thin typer layer over the library.

Each command lives in its own module below this package and registers itself on `app`. What reaches
the user on stderr (`main`):
- bad input (`SailorInputError`, and typer's usage errors): one `error:` line, exit status 2;
- input taken with a change (`sailor.core.errors.SailorWarning`): one `warning:` line, the command goes on;
- where the profile of this machine came from (`cli.common.NOTES_AT_END`): a line once the command
  has succeeded, so that an error after it is still the only line;
- output that cannot be written (a full disk, `> /dev/full`): one `error:` line, exit status 1;
- a reader that leaves early (`sailor plan | head -1`): nothing more, exit status 0. The reader took
  what it wanted; 0 keeps `set -o pipefail` scripts going (the shell's own 141, a death by SIGPIPE,
  would fail them, and Python ignores SIGPIPE, so the write raises BrokenPipeError instead);
- Ctrl-C (SIGINT) or SIGTERM: the command unwinds as from an exception (`Interrupted`: its ranks
  ended, its scratch folders removed), then one line, exit status 130 (SIGINT) or 143 (SIGTERM),
  the shell's figures for a death by those signals. `sailor train` and `sailor run` install their
  own stop protocol instead while they run. A signal ignored when the process started stays ignored
  (SIGINT in a script's background job);
- anything else (a bug): one `error: internal error ...` line naming a file that holds the
  traceback, exit status 1. Never a bare traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings

import typer

from sailor.cli.app import app
from sailor.core.errors import SailorInputError, SailorWarning, one_line


def _register() -> None:
    # Importing a command module registers its commands on `app`. Heavy imports (torch) stay inside
    # the command functions so `sailor plan` starts fast.
    from sailor.cli import data, elastic, export, launch, plan, profile, simulate, testbed, train, validate  # noqa: F401
    from sailor.cli.common import pipe_safe_help
    pipe_safe_help()  # help into a pipe whose reader left ends as other output does



def main() -> None:
    """Console-script entry point: runs the app, turning input errors into one line and exit 2,
    warnings into one line each, and any other exception into one line and exit 1 (module docstring).

    Usage errors (unknown option, bad option value, missing argument) are one line and exit 2 too:
    typer would otherwise draw a multi-line box.
    """
    # typer bundles its own copy of click; its exception base class lives there.
    from typer.core import _click

    with warnings.catch_warnings(), _signals_unwind():
        warnings.simplefilter("always", SailorWarning)  # every file's note, not only the first
        warnings.showwarning = _show_warning
        try:
            if sys.stdout is None:  # started with stdout closed (`>&-`): what it prints would vanish
                raise SailorInputError("standard output is closed; redirect it (>/dev/null to discard it)",
                                       source="stdout")
            _register()
            from sailor.cli.common import NOTES_AT_END
            NOTES_AT_END.clear()
            code = app(standalone_mode=False)
            sys.stdout.flush()  # a full disk or a closed pipe shows here, not at interpreter exit
            for line in NOTES_AT_END:
                print(line, file=sys.stderr)
        except SailorInputError as e:
            print(f"error: {e.one_line()}", file=sys.stderr)
            sys.exit(2)
        except _click.exceptions.ClickException as e:
            message = " ".join(e.format_message().replace("Value error, ", "").split())
            print(f"error: {one_line(message)} (see --help)", file=sys.stderr)
            sys.exit(e.exit_code)
        except Interrupted as e:
            name = signal.Signals(e.signum).name
            print(f"{'interrupted' if e.signum == signal.SIGINT else 'terminated'} ({name})", file=sys.stderr)
            sys.exit(128 + e.signum)
        except (typer.Abort, KeyboardInterrupt):
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        except (SystemExit, typer.Exit):
            raise
        except BrokenPipeError:  # the reader left (`sailor plan | head -1`): quietly, status 0 (docstring)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit goes nowhere
            sys.exit(0)
        except OSError as e:
            if e.errno not in _WRITE_ERRNOS:
                _internal_error(e)
            print(f"error: the output could not be written: {e.strerror or e}", file=sys.stderr)
            sys.exit(1)
        except BaseException as e:  # a bug: one line, the traceback in a file
            _internal_error(e)
    sys.exit(code if isinstance(code, int) else 0)


class Interrupted(BaseException):
    """SIGINT or SIGTERM, raised in the main thread while `main` runs (`_signals_unwind`). A
    BaseException, as KeyboardInterrupt is, so that `except Exception` lets it through and every
    `finally` and context manager on the way runs (ranks ended, scratch folders removed); not a
    KeyboardInterrupt, which typer turns into a silent exit status 130."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def _signals_unwind():
    """While the block runs, SIGINT and SIGTERM raise `Interrupted` in the main thread, instead of a
    KeyboardInterrupt and of an end with no cleanup at all. A signal ignored when the process started
    stays ignored (SIGINT in a script's background job), one handled already stays handled; the
    previous handlers come back after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    default = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    previous = {s: signal.getsignal(s) for s in default}
    mine = [s for s in default if previous[s] is default[s]]
    for s in mine:
        signal.signal(s, _raise_interrupted)
    try:
        yield
    finally:
        for s in mine:
            signal.signal(s, previous[s])


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signum)


# A write that failed for want of room or a device (the output on a full disk, `> /dev/full`): no bug.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


def _internal_error(e: BaseException) -> None:
    """A bug: one line naming the file that holds the traceback, exit status 1."""
    print(f"error: internal error ({one_line(type(e).__name__ + ': ' + str(e))[:300]}); {_save_traceback()}",
          file=sys.stderr)
    sys.exit(1)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning for the CLI: a SailorWarning as one `warning:` line; others as usual."""
    if issubclass(category, SailorWarning):
        print(f"warning: {one_line(str(message))}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


TRACEBACK_DIR_ENV = "SAILOR_TRACEBACK_DIR"  # where internal-error tracebacks go (default: the temp folder)


def _save_traceback() -> str:
    """Write the current exception's traceback to a new file; says where (or why it could not)."""
    folder = os.environ.get(TRACEBACK_DIR_ENV) or tempfile.gettempdir()
    try:
        os.makedirs(folder, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=time.strftime("sailor-traceback-%Y%m%d-%H%M%S-"), suffix=".txt",
                                    dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"sailor {' '.join(sys.argv[1:])}\n\n{traceback.format_exc()}")
        return f"traceback saved to {path}; please report it"
    except OSError as e:
        return f"the traceback could not be saved ({e.strerror})"
