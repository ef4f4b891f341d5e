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


# Options that write a file or folder (a missing folder on their path is created: the help says so).
OUTPUTS = {"--out", "--report", "--metrics", "--events"}


def _commands(command, path=()):
    """(command path, click command) of `command` and every command below it (a group such as
    `profile` takes options of its own)."""
    yield " ".join(path), command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_output_option_says_it_creates_missing_folders():
    _register()
    outputs = {(name, o): " ".join((p.help or "").split()) for name, command in _commands(typer.main.get_command(app))
               for p in command.params for o in p.opts if o in OUTPUTS}
    assert {("plan", "--out"), ("profile", "--out"), ("run", "--events"), ("train", "--metrics")} <= set(outputs)
    silent = sorted(k for k, text in outputs.items() if "Missing folders on its path are created." not in text)
    assert silent == []


def test_plan_out_creates_its_missing_folders(tmp_path, monkeypatch, capsys):
    import sys

    from sailor.cli import main

    out = tmp_path / "runs" / "exp3" / "plan.json"
    monkeypatch.setattr(sys, "argv", ["sailor", "plan", "--job", str(README.parent / "examples" / "tiny_job.yaml"),
                                      "--cluster", str(README.parent / "examples" / "two_zones.yaml"), "--out", str(out),
                                      "--json"])
    try:
        main()
    except SystemExit as e:
        assert e.code == 0, capsys.readouterr().err
    assert out.exists()
