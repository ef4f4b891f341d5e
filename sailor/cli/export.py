"""`sailor export CHECKPOINT --to DIR`: a Sailor checkpoint as a Hugging Face model folder."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from sailor.cli.app import app
from sailor.cli.common import JsonOpt, console, require_torch
from sailor.core.fileio import check_output_path


@app.command("export")
def export_command(
    checkpoint: Path = typer.Argument(..., metavar="CHECKPOINT", help="A checkpoint folder (--checkpoint-dir of"
                                                                      " sailor train: its newest verified step) or"
                                                                      " one step-<n> folder in it."),
    to: Path = typer.Option(..., "--to", help="Hugging Face model folder to create (config.json + safetensors);"
                                              " must not exist or be empty."),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-gb", min=0.001, help="Largest safetensors file (GB, 1e9"
                                                                               " bytes); more become shards with an"
                                                                               " index, e.g. 5."),
    as_json: bool = JsonOpt,
) -> None:
    """Write CHECKPOINT's weights as a model transformers loads (`from_pretrained(DIR)`)."""
    require_torch("export", "safetensors")
    check_output_path(to, "--to", folder=True)
    from sailor.runtime.hf_weights import export_checkpoint

    summary = export_checkpoint(checkpoint, to, max_shard_bytes=int(max_shard_gb * 1e9))
    if as_json:
        print(json.dumps(summary))
        return
    console().print(f"{to}: {summary['model_type']} model, {summary['parameters']:,} parameters, step"
                    f" {summary['step']} ({', '.join(summary['files'])})")
