"""Deterministic training data, indexed by global sample number: byte tokens from a local text corpus
(the default), or a pre-tokenized token file (`sailor.runtime.tokens`, memory-mapped).

Sample `n` of step `s` is the `seq + 1` bytes starting at an offset that is a hash of (seed, s, n),
so the global order depends only on (seed, step, sample index), never on the plan; a pipeline whose
share starts at global sample `first` takes samples first, first + 1, ... contiguously. The inputs are
the first `seq` bytes, the targets the last `seq` (next-token prediction). Torch-free.

Default corpus: the help topics that ship with Python (`pydoc_data.topics`, ~465 kB of English and
code), so tests and demos need no download. `--data PATH` takes a text file, or a folder whose files
are read in sorted order and concatenated, as bytes; or a token file (`.bin`, `.npy`), whose ids are
used as they are.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from sailor.core.errors import SailorInputError
from sailor.runtime.tokens import TokenFile, check_tokens, is_token_file, open_tokens

BYTE_VOCAB = 256  # token ids are byte values


def load_corpus(path: str | Path | None = None) -> np.ndarray | TokenFile:
    """The corpus: a memory-mapped token file for a `.bin`/`.npy` path, else a uint8 array of byte
    tokens; raises SailorInputError for a missing/empty path or an unreadable token file."""
    if is_token_file(path):
        return open_tokens(path)
    if path is None:
        from pydoc_data.topics import topics
        text = "\n\n".join(topics[k] for k in sorted(topics))
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    p = Path(path)
    if not p.exists():
        raise SailorInputError("no such file or folder", source=str(p), fix="pass a text file or a folder of them")
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    data = b"".join(f.read_bytes() for f in files)
    if not data:
        raise SailorInputError("the training data is empty", source=str(p))
    return np.frombuffer(data, dtype=np.uint8)


def check_corpus(corpus: np.ndarray | TokenFile, *, seq: int, vocab_size: int, source: str = "--data") -> None:
    """Raise SailorInputError unless the corpus holds one sample of `seq` tokens and fits the vocabulary."""
    if len(corpus) < seq + 1:
        raise SailorInputError(f"the corpus has {len(corpus)} tokens, fewer than one sample of {seq} + 1",
                               source=source)
    if isinstance(corpus, TokenFile):
        check_tokens(corpus, vocab_size=vocab_size, source=source)
    elif vocab_size < BYTE_VOCAB:
        raise SailorInputError(f"byte tokens need a vocabulary of {BYTE_VOCAB}, the model has {vocab_size}",
                               source=source)


def sample_offset(seed: int | str, step: int, index: int, span: int) -> int:
    """Start of sample `index` of step `step` (0-based) in [0, span)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % span


def batch_tokens(corpus: np.ndarray | TokenFile, *, seed: int | str, step: int, first: int, count: int, seq: int) -> np.ndarray:
    """Samples first .. first + count - 1 of step `step`: an int64 array (count, seq + 1)."""
    span = len(corpus) - seq
    rows = [corpus[o:o + seq + 1] for o in (sample_offset(seed, step, n, span) for n in range(first, first + count))]
    return np.stack(rows).astype(np.int64)


EVAL_SEED = "eval"  # the held-out samples' own stream: the same on every run, whatever its seed


def eval_tokens(corpus: np.ndarray | TokenFile, *, batch: int, first: int, count: int, seq: int) -> np.ndarray:
    """Samples first .. first + count - 1 of held-out batch `batch` (0-based) of an evaluation: an int64
    array (count, seq + 1), the same at every evaluation of every run (`EVAL_SEED`)."""
    return batch_tokens(corpus, seed=EVAL_SEED, step=batch, first=first, count=count, seq=seq)
