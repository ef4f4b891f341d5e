"""The `sailor` command line: a thin typer layer over the library.

Each command lives in its own module below this package and registers itself on `app`. Bad input
(`SailorInputError`) is printed as one line on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import sys

import typer

from sailor.errors import SailorInputError

# add_completion: `sailor --install-completion` / `--show-completion` (bash, zsh, fish, PowerShell).
app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Sailor: plan, simulate and run LLM training on heterogeneous, geo-distributed GPUs.")


def _print_version(value: bool) -> None:
    if value:
        from sailor import __version__
        print(f"sailor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the version and exit.")) -> None:
    """Sailor: plan, simulate and run LLM training on heterogeneous, geo-distributed GPUs."""


def _register() -> None:
    # Importing a command module registers its commands on `app`. Heavy imports (torch) stay inside
    # the command functions so `sailor plan` starts fast.
    from sailor.cli import simulate  # noqa: F401
    for name in ("plan", "train", "validate", "profile", "elastic", "report", "launch", "data", "export"):
        try:
            __import__(f"sailor.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"sailor.cli.{name}":
                raise


def fail(message: str) -> "typer.Exit":
    """Print one error line on stderr and return the exit-2 exception to raise."""
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(code=2)


def main() -> None:
    """Console-script entry point: runs the app, turning input errors into one line and exit 2.

    Usage errors (unknown option, bad option value, missing argument) are one line and exit 2 too:
    typer would otherwise draw a multi-line box.
    """
    # typer bundles its own copy of click; its exception base class lives there.
    from typer.core import _click

    _register()
    try:
        code = app(standalone_mode=False)
    except SailorInputError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        sys.exit(2)
    except _click.exceptions.ClickException as e:
        message = " ".join(e.format_message().replace("Value error, ", "").split())
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
