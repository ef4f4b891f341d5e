"""Pre-tokenized training data, memory-mapped: flat token files as nanoGPT and Megatron-LM write them,
`.npy` arrays, and the files `sailor data prepare` writes (torch-free).

Formats (`open_tokens`):
- `NAME.npy`: a 1-D integer array (the dtype and length come from its header);
- `NAME.bin`: token ids back to back (nanoGPT's `train.bin`, Megatron-LM's `.bin`). The dtype comes
  from a sidecar `NAME.bin.json` (`{"dtype": "uint32"}`, written by `sailor data prepare`), else from
  Megatron's `NAME.idx` header (its dtype code), else uint16, nanoGPT's choice. Megatron's document
  boundaries are not used: samples are windows of the token stream, as in nanoGPT.

The sidecar of a prepared file also records the tokenizer's vocabulary size and the largest id, so
the check against the model's vocabulary (`check_tokens`) needs no scan; any other file is scanned
once in chunks.

`TokenFile` maps the file read-only and gives `len()` and slices, which is all the sampler
(`sailor.runtime.data.batch_tokens`) needs. Pages a slice touched stay in the page cache, but are
dropped from this process's resident set (`madvise(MADV_DONTNEED)`) once reads may have mapped
`RELEASE_BYTES`, so resident memory stays bounded however large the file (`benchmarks/data_stream.py`).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from sailor.core.errors import SailorInputError, show

TOKEN_SUFFIXES = (".npy", ".bin")
SIDECAR_FORMAT = "sailor-tokens-1"
RELEASE_BYTES = 64 * 2**20  # drop mapped pages from the resident set once reads may have mapped this much
# What one read may make resident at most: a page fault maps the whole page-cache folio around it,
# and Linux 6.x caches files in large folios of up to the PMD size, 2 MiB on x86-64 (measured here:
# one 2-byte read of a cached file adds 2048 KiB to RssFile).
MAPPED_PER_READ = 2 * 2**20
SCAN_TOKENS = 16 * 2**20  # tokens per chunk when scanning a file for its largest id
# Megatron-LM `megatron/core/datasets/indexed_dataset.py`: the .idx file starts with this magic, a
# little-endian uint64 version (1) and a uint8 dtype code of its `DType` enum.
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def is_token_file(path: str | Path | None) -> bool:
    """True when `--data PATH` names a token file (by its suffix) rather than text."""
    return path is not None and Path(path).suffix.lower() in TOKEN_SUFFIXES


def sidecar(path: str | Path) -> Path:
    """The metadata file next to a token file: NAME.bin -> NAME.bin.json."""
    p = Path(path)
    return p.with_name(p.name + ".json")


class TokenFile:
    """A read-only memory map of `count` token ids of `dtype` starting at byte `offset` of `path`.

    `len(t)` is the number of tokens; `t[a:b]` a copy of those ids (numpy, the file's dtype).
    `meta` is the sidecar's content ({} without one).
    """

    def __init__(self, path: Path, dtype: np.dtype, offset: int, count: int, meta: dict[str, Any]) -> None:
        self.path, self.dtype, self.offset, self.count, self.meta = path, np.dtype(dtype), offset, count, meta
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM"):  # samples are random windows: no read-ahead
            self._mm.madvise(mmap.MADV_RANDOM)
        self._ids = np.frombuffer(self._mm, dtype=self.dtype, count=count, offset=offset)
        self._read = 0

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: slice) -> np.ndarray:
        out = np.array(self._ids[key])
        self._read += out.nbytes + MAPPED_PER_READ
        if self._read >= RELEASE_BYTES:
            self.release()
        return out

    def release(self) -> None:
        """Drop the mapped pages from this process's resident memory (they stay in the page cache)."""
        self._read = 0
        if hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED)

    def max_id(self) -> int:
        """The largest token id: the sidecar's when it describes this very file, else a chunked scan."""
        st = self.path.stat()
        if self.meta.get("bytes") == st.st_size and isinstance(self.meta.get("max_id"), int):
            return self.meta["max_id"]
        top = -1
        for a in range(0, self.count, SCAN_TOKENS):
            top = max(top, int(self._ids[a:a + SCAN_TOKENS].max()))
            self.release()
        return top

    def min_id(self) -> int:
        """The smallest token id (a chunked scan; only signed dtypes can go below 0)."""
        if self.dtype.kind == "u":
            return 0
        low = 0
        for a in range(0, self.count, SCAN_TOKENS):
            low = min(low, int(self._ids[a:a + SCAN_TOKENS].min()))
            self.release()
        return low


def open_tokens(path: str | Path) -> TokenFile:
    """Map token file `path` (module docstring for the formats).

    Raises:
        SailorInputError: missing file, a header or sidecar that cannot be read, a dtype that is
            not an integer type, a size that is not a whole number of tokens, or no tokens.
    """
    p = Path(path)
    if not p.is_file():
        raise SailorInputError("no such file", source=str(p), fix="pass a .bin or .npy token file")
    meta = _read_sidecar(p)
    if p.suffix.lower() == ".npy":
        dtype, offset, count = _npy_layout(p)
    else:
        dtype = _bin_dtype(p, meta)
        offset, size = 0, p.stat().st_size
        if size % dtype.itemsize:
            raise SailorInputError(f"{size} bytes is not a whole number of {dtype.name} tokens", source=str(p),
                                   fix=f"give the dtype in {sidecar(p).name}, e.g. {{\"dtype\": \"uint32\"}}")
        count = size // dtype.itemsize
    if dtype.kind not in "iu" or dtype.itemsize > 8:
        raise SailorInputError(f"token ids must be integers, the file holds {dtype.name}", source=str(p))
    if count == 0:
        raise SailorInputError("the token file holds no tokens", source=str(p))
    return TokenFile(p, dtype, offset, count, meta)


def _read_sidecar(p: Path) -> dict[str, Any]:
    s = sidecar(p)
    if not s.exists():
        return {}
    from sailor.core.fileio import load_json

    meta = load_json(s)
    if not isinstance(meta, dict):
        raise SailorInputError("expected a JSON object", source=str(s))
    return meta


def _npy_layout(p: Path) -> tuple[np.dtype, int, int]:
    with open(p, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = header(f)
        except (ValueError, OSError) as e:
            raise SailorInputError(f"not a readable .npy file ({e})", source=str(p)) from None
        offset = f.tell()
    if len(shape) != 1:
        raise SailorInputError(f"expected a 1-D array of token ids, got shape {shape}", source=str(p))
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and not np.little_endian):
        raise SailorInputError("big-endian token ids are not supported", source=str(p))
    need = offset + shape[0] * dtype.itemsize
    if p.stat().st_size < need:
        raise SailorInputError(f"truncated: {p.stat().st_size} bytes, the header says {need}", source=str(p))
    return dtype, offset, shape[0]


def _bin_dtype(p: Path, meta: dict[str, Any]) -> np.dtype:
    if "dtype" in meta:
        try:
            return np.dtype(meta["dtype"])
        except TypeError:
            raise SailorInputError(f"unknown dtype {show(meta['dtype'])}", source=str(sidecar(p)), field="dtype") from None
    idx = p.with_suffix(".idx")
    if idx.exists():
        with open(idx, "rb") as f:
            head = f.read(len(MEGATRON_MAGIC) + 9)
        if not head.startswith(MEGATRON_MAGIC) or len(head) < len(MEGATRON_MAGIC) + 9:
            raise SailorInputError("not a Megatron-LM index (MMIDIDX) file", source=str(idx))
        (code,) = struct.unpack("<B", head[-1:])
        if code not in MEGATRON_DTYPES:
            raise SailorInputError(f"dtype code {code} is not an integer type", source=str(idx))
        return np.dtype(MEGATRON_DTYPES[code])
    return np.dtype(np.uint16)


def check_tokens(tokens: TokenFile, *, vocab_size: int, source: str | None = None) -> None:
    """Raise SailorInputError unless every id (and the tokenizer's vocabulary, when the sidecar
    records it) fits a model vocabulary of `vocab_size`."""
    src = source or str(tokens.path)
    tok_vocab = tokens.meta.get("vocab_size")
    if isinstance(tok_vocab, int) and tok_vocab > vocab_size:
        raise SailorInputError(f"the tokenizer's vocabulary ({tok_vocab}) is larger than the model's ({vocab_size})",
                               source=src, fix="use the model's own tokenizer, or a model with a larger vocab_size")
    top = tokens.max_id()
    if top >= vocab_size:
        raise SailorInputError(f"token id {top} is beyond the model's vocabulary of {vocab_size}", source=src,
                               fix="tokenize with the model's tokenizer")
    if tokens.min_id() < 0:
        raise SailorInputError("negative token ids", source=src)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype for ids below `vocab_size` (uint16 as nanoGPT, else uint32)."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def sidecar_meta(path: Path, *, dtype: np.dtype, count: int, vocab_size: int, max_id: int,
                 extra: dict[str, Any]) -> dict[str, Any]:
    """The sidecar of a token file written by `sailor data prepare` (`bytes` ties it to that file)."""
    return {"format": SIDECAR_FORMAT, "dtype": dtype.name, "tokens": count, "bytes": os.path.getsize(path),
            "vocab_size": vocab_size, "max_id": max_id, **extra}


def write_npy_header(f, dtype: np.dtype, count: int) -> int:
    """Write a .npy (1.0) header for `count` ids of `dtype` at the start of binary file `f`; returns
    its length. The length is the same for every count up to 10^18 (numpy pads headers to 64
    bytes), so a placeholder can be rewritten once the count is known."""
    f.seek(0)
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                             "shape": (count,)})
    return f.tell()
