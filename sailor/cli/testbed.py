"""`sailor testbed up|down|exec`: an emulated cluster on this machine (`sailor.testbed`; needs root)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from sailor.cli.app import app
from sailor.cli.common import MAKES_FOLDERS
from sailor.core.errors import SailorInputError, one_line

testbed_app = typer.Typer(no_args_is_help=True, help="A cluster in a box: nodes as network namespaces, shaped"
                                                     " links, CPU quotas as device speeds (needs root).")
app.add_typer(testbed_app, name="testbed")

StateDirOpt = typer.Option(None, "--state-dir", help="Folder of the testbeds' state, cluster spec, hosts file and"
                           " stand-in ssh (default $SAILOR_TESTBED_STATE, else /run/sailor-testbed).")


@testbed_app.command("up")
def up_command(
    file: Path = typer.Argument(..., metavar="FILE", help="Testbed file (YAML): devices, links, nodes."),  # noqa: B008
    state_dir: str | None = StateDirOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of lines."),
) -> None:
    """Create the testbed FILE describes (removing a previous one of its name first)."""
    from sailor.testbed import load_testbed, up
    from sailor.testbed.host import as_dict
    spec = load_testbed(file)
    state = up(spec, state_dir, source=str(file))
    info = as_dict(state)
    if as_json:
        print(json.dumps(info))
        return
    for n in info["nodes"]:
        print(f"{n['name']}: {n['address']} (netns {n['netns']})")
    print(f"cluster spec: {info['cluster']}\nhosts file: {info['hosts']}\n"
          f"stand-in ssh: export PATH={Path(info['ssh']).parent}:$PATH")


@testbed_app.command("down")
def down_command(
    file: str | None = typer.Argument(None, metavar="FILE|NAME", help="Testbed file, or the testbed's name."),
    all_: bool = typer.Option(False, "--all", help="Remove every testbed of the state folder, and anything"
                              " a killed run left that no live testbed (of any state folder) owns."),
    state_dir: str | None = StateDirOpt,
) -> None:
    """Remove a testbed: its processes, namespaces, links, qdiscs, cgroups and state. A testbed that
    is not up is nothing to remove (exit 0, saying so); a --state-dir that does not exist is refused
    (with FILE|NAME: it names no testbed)."""
    from sailor.testbed import down, down_all
    from sailor.testbed.host import check_support, live_states, state_root, testbed_name

    if (file is None) == (not all_):
        raise SailorInputError("give FILE|NAME or --all (one of them)", source="sailor testbed down")
    check_support()
    if all_:  # (strays of killed runs too, with or without a state folder)
        removed = down_all(state_dir)
        print(f"removed {len(removed)} testbed(s){': ' + ', '.join(removed) if removed else ''}")
        return
    root = state_root(state_dir)
    if state_dir is not None and not root.exists():  # (the default folder is missing until a first `up`)
        raise SailorInputError(f"{root} does not exist: no testbed was ever up there", source="--state-dir",
                               fix="name the folder `sailor testbed up` was given")
    name = testbed_name(file)
    states = live_states(state_dir)
    state = next((s for s in states if s.name == name), None)
    if state is None:  # taking down what is down leaves it as asked: a success, said in a line
        others = f"; up there: {', '.join(s.name for s in states)}" if states else ""
        print(f"testbed {name} is not up (state in {root}): nothing to remove{others}")
        return
    down(state)
    print(f"removed testbed {state.name} ({state.prefix})")


@testbed_app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_command(
    node: str = typer.Argument(..., metavar="NODE", help="Node name or address (in any live testbed)."),
    command: list[str] = typer.Argument(..., metavar="-- CMD...", help="Command to run inside the node."),  # noqa: B008
    state_dir: str | None = StateDirOpt,
) -> None:
    """Run CMD inside NODE's network namespace and cgroup (replaces this process). Options go before
    NODE: everything after it is the command."""
    from sailor.testbed.host import check_support, enter_argv, locate

    check_support()
    _, n = locate(node, state_dir, source="sailor testbed exec")
    argv = enter_argv(n, command[1:] if command[:1] == ["--"] else command)
    os.execvp(argv[0], argv)


@testbed_app.command("profile")
def profile_command(
    file: Path = typer.Argument(..., metavar="FILE", help="Testbed file of a testbed that is up."),  # noqa: B008
    job: Path = typer.Option(..., "--job", help="Job spec (YAML/JSON): model, sequence length, precision."),  # noqa: B008
    mbs: str = typer.Option("1,2,4", "--mbs", help="Micro-batch sizes (samples), comma-separated, e.g. 1,2,4."),
    out: Path = typer.Option(Path("profile.json"), "--out",  # noqa: B008
                             help="Profile file to write (JSON, sailor.profiles/1)." + MAKES_FOLDERS),
    state_dir: str | None = StateDirOpt,
) -> None:
    """Measure each device class with `sailor profile` inside a node of the class, each rank under
    its own quota, at every TP degree the node's ranks allow, while every other rank of the testbed
    runs a profile too (as a run keeps them busy); one profile file, its rows named after the
    classes' GPU types (for `sailor plan --profiles`)."""
    from sailor.cli.profile import check_profile_options, int_list
    from sailor.core.fileio import check_output_path, write_json
    from sailor.perf.profiles import profiles_from_dict
    from sailor.runtime.profiler import ProfileOptions
    from sailor.specs import load_job
    from sailor.testbed import find_state, load_testbed
    from sailor.testbed.host import check_support
    from sailor.testbed.profile import class_tps, profile_classes

    check_support()
    spec = load_testbed(file)
    # what each class's `sailor profile` would refuse (profile_command's settings), refused here first
    tps = sorted({t for degrees in class_tps(spec, load_job(job).model).values() for t in degrees})
    check_profile_options(ProfileOptions(job=load_job(job), device="cpu", tps=tuple(tps), mbs=int_list(mbs, "--mbs"),
                                         threads=1, concurrency=1), job)
    check_output_path(out, "--out", inputs={"FILE": file, "--job": job})
    try:
        data = profile_classes(spec, find_state(spec.name, state_dir), job.resolve(), mbs=mbs)
    except RuntimeError as e:  # a class's `sailor profile` failed inside its node: its output, exit 1
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        raise typer.Exit(code=1) from None
    profiles_from_dict(data, str(out))
    write_json(out, data)
    print(f"profile of {', '.join(f'{n} as {d.gpu}' for n, d in spec.devices.items())} written to {out}")
