"""The typer application every command registers itself on (`sailor.cli` imports the command
modules; each takes `app` from here, so no command module imports the package that imports it)."""

from __future__ import annotations

import typer

# add_completion: `sailor --install-completion` / `--show-completion` (bash, zsh, fish, PowerShell).
app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Sailor: plan, simulate and run LLM training on heterogeneous, geo-distributed GPUs.")


def _print_version(value: bool) -> None:
    if value:
        from sailor.core import __version__
        print(f"sailor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the version and exit.")) -> None:
    """Sailor: plan, simulate and run LLM training on heterogeneous, geo-distributed GPUs."""


