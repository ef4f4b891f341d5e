"""`sailor export CHECKPOINT --to DIR`: a Sailor checkpoint as a Hugging Face model folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

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
    source: Optional[Path] = typer.Option(None, "--source", help="Hugging Face folder of the same model whose token"
                                          " ids, dropout, generation_config.json and tokenizer files the export"
                                          " keeps (default: the --init-from folder the checkpoint records)."),
    as_json: bool = JsonOpt,
) -> None:
    """Write CHECKPOINT's weights as a model transformers loads (`from_pretrained(DIR)`), with the
    token ids, dropout rates, generation config and tokenizer of the folder training started from."""
    require_torch("export", "safetensors")
    check_output_path(to, "--to", folder=True, inputs={"CHECKPOINT": checkpoint, "--source": source})
    from sailor.runtime.hf_weights import export_checkpoint

    summary = export_checkpoint(checkpoint, to, max_shard_bytes=int(max_shard_gb * 1e9), source=source)
    if summary["kept_from"] is None:
        print("note: no Hugging Face folder known for this checkpoint: token ids, dropout, generation config and"
              " tokenizer not written (pass --source FOLDER)", file=sys.stderr)
    elif not any(f.startswith("tokenizer") for f in summary["files"]):
        print(f"note: no tokenizer files from {summary['kept_from']}", file=sys.stderr)
    if as_json:
        print(json.dumps(summary))
        return
    console().print(f"{to}: {summary['model_type']} model, {summary['parameters']:,} parameters, step"
                    f" {summary['step']} ({', '.join(summary['files'])})")
