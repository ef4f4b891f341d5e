"""`sailor data prepare`: tokenize text or JSONL into a memory-mappable token file for `--data`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sailor.cli.app import app
from sailor.cli.common import MAKES_FOLDERS, JsonOpt, console, progress_bar

data_app = typer.Typer(no_args_is_help=True, help="Training data: tokenize text into token files.")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def prepare_command(
    inputs: list[Path] = typer.Argument(..., metavar="INPUT...", help="Text files (one document each) or .jsonl"
                                                                      " files (one document per line)."),
    tokenizer: Path = typer.Option(..., "--tokenizer", help="Hugging Face tokenizer.json (the `tokenizers` format)."),
    out: Path = typer.Option(..., "--out", help="Token file to write: NAME.npy, or NAME.bin (flat ids, as nanoGPT);"
                                                " its metadata goes to NAME.npy.json / NAME.bin.json." + MAKES_FOLDERS),
    text_field: str = typer.Option("text", "--text-field", help="Field of each JSONL record holding its text."),
    eos: Optional[str] = typer.Option(None, "--eos", help="Token appended after every document, e.g. '</s>'."),
    job: Optional[Path] = typer.Option(None, "--job", help="Job spec: refuse a tokenizer whose vocabulary is larger"
                                                           " than its model's before tokenizing."),
    as_json: bool = JsonOpt,
) -> None:
    """Tokenize INPUT... with a tokenizer.json into one token file, written atomically."""
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from sailor.runtime.dataprep import check_inputs, prepare_tokens
    from sailor.specs import load_job

    model_vocab = load_job(job).model.vocab_size if job else None
    total = sum(p.stat().st_size for p in check_inputs(inputs))
    columns = [TextColumn("tokenize"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
    # transient: the bar goes when it ends, so that an error found while tokenizing is the only line
    with progress_bar(*columns) as bar:
        task = bar.add_task("tokenize", total=total)
        summary = prepare_tokens(inputs, tokenizer=tokenizer, out=out, text_field=text_field, eos=eos,
                                 model_vocab=model_vocab, progress=lambda n: bar.advance(task, n))
    if as_json:
        print(json.dumps(summary))
        return
    console().print(f"{summary['out']}: {summary['tokens']:,} tokens ({summary['dtype']}), documents"
                    f" {summary['documents']:,}, vocabulary {summary['vocab_size']:,}, {summary['seconds']:.1f} s")
