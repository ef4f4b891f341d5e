"""README's Usage lines name every option each command takes, and no option a command lacks (read
from the typer application, nothing is run)."""

import re
from pathlib import Path

import typer

from sailor.cli import _register, app

README = Path(__file__).resolve().parents[1] / "README.md"
GLOBAL = {"--help", "--version", "--install-completion", "--show-completion"}


def usage_entries() -> dict[str, set[str]]:
    """{command path ("plan", "profile network"): the options its Usage entry names}."""
    block = README.read_text().split("## Usage", 1)[1].split("\n\n", 2)[1]
    _register()
    root = typer.main.get_command(app)
    out = {}
    for entry in re.split(r"\n    (?=sailor )", "\n" + block):
        words, command, path = entry.split(), root, []
        for w in words[1:]:
            if w not in getattr(command, "commands", {}):
                break
            command = command.commands[w]
            path.append(w)
        if path:
            out[" ".join(path)] = (set(re.findall(r"--[a-z][a-z0-9-]*", entry)),
                                   {o for p in command.params for o in (*p.opts, *p.secondary_opts)  # a flag's off form too
                                    if o.startswith("--")} - GLOBAL)
    return out


def test_usage_names_every_option_of_every_command():
    entries = usage_entries()
    assert {"plan", "simulate", "train", "run", "launch", "profile network"} <= set(entries)
    wrong = {name: (sorted(real - doc), sorted(doc - real)) for name, (doc, real) in entries.items() if doc != real}
    assert wrong == {}  # {command: (options missing from README, options README names that do not exist)}
