"""Stream a token file larger than 2 GB through the training sampler with bounded resident memory.

Writes a flat uint16 token file (nanoGPT's format) of `--gb` GB (default 2.2) of random ids in a
temporary folder, then draws training batches from it exactly as `sailor train` does
(`sailor.runtime.data.batch_tokens` on the memory-mapped `TokenFile`): first from a cold page cache
(the file's pages evicted with posix_fadvise(DONTNEED), so samples come from disk), then warm. Reports
samples/s and tokens/s of each pass, the peak of the process's resident memory (ru_maxrss, the whole
run including writing) and of its file-backed part while sampling (RssFile), and deletes the file.
Target: peak resident memory < 200 MB. Ends with one JSON line. Torch is not imported (the sampler
is torch-free), so the figure is the data path's own.

    python benchmarks/data_stream.py [--gb 2.2] [--seconds 20] [--seq 2048] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sailor.runtime.data import batch_tokens, check_corpus, load_corpus  # noqa: E402

TARGET_RSS_BYTES = 200e6
CHUNK_TOKENS = 8 * 2**20  # 16 MB written at a time


def rss_file_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    return 0


def write_tokens(path: Path, n_tokens: int, vocab: int) -> float:
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for a in range(0, n_tokens, CHUNK_TOKENS):
            f.write(rng.integers(0, vocab, min(CHUNK_TOKENS, n_tokens - a), dtype=np.uint16).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def sample(corpus, *, seconds: float, batch: int, seq: int, first_step: int) -> dict:
    steps = samples = 0
    peak_file = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        rows = batch_tokens(corpus, seed=0, step=first_step + steps, first=0, count=batch, seq=seq)
        assert rows.shape == (batch, seq + 1)
        steps += 1
        samples += batch
        peak_file = max(peak_file, rss_file_bytes())
    dt = time.perf_counter() - t0
    return {"steps": steps, "samples": samples, "seconds": round(dt, 2), "samples_per_s": round(samples / dt, 1),
            "tokens_per_s": round(samples * seq / dt), "peak_rss_file_bytes": peak_file}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.2, help="size of the token file (GB, 1e9 bytes)")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of sampling per pass")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    ap.add_argument("--batch", type=int, default=64, help="samples per step (a global batch)")
    ap.add_argument("--vocab", type=int, default=50257, help="ids are drawn below this (GPT-2's vocabulary)")
    args = ap.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="sailor-data-stream-"))
    try:
        path = folder / "train.bin"
        n_tokens = int(args.gb * 1e9) // 2
        write_s = write_tokens(path, n_tokens, args.vocab)
        size = path.stat().st_size
        print(f"wrote {path} ({size / 1e9:.2f} GB, {n_tokens:,} uint16 tokens) in {write_s:.1f} s")
        corpus = load_corpus(path)
        t0 = time.perf_counter()
        check_corpus(corpus, seq=args.seq, vocab_size=args.vocab)  # the launcher's scan for ids beyond the vocabulary
        scan_s = time.perf_counter() - t0
        print(f"checked every id against the vocabulary in {scan_s:.1f} s")
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evict this file's pages: the first pass reads disk
        os.close(fd)
        cold = sample(corpus, seconds=args.seconds, batch=args.batch, seq=args.seq, first_step=0)
        warm = sample(corpus, seconds=args.seconds, batch=args.batch, seq=args.seq, first_step=cold["steps"])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"{'pass':<6}{'samples/s':>12}{'tokens/s':>14}{'peak RssFile (MB)':>20}")
        for name, r in (("cold", cold), ("warm", warm)):
            print(f"{name:<6}{r['samples_per_s']:>12,.0f}{r['tokens_per_s']:>14,}{r['peak_rss_file_bytes'] / 1e6:>20.1f}")
        ok = peak < TARGET_RSS_BYTES
        print(f"peak resident memory {peak / 1e6:.1f} MB (target < {TARGET_RSS_BYTES / 1e6:.0f} MB): {'ok' if ok else 'MISSED'}")
        print(json.dumps({"benchmark": "data_stream", "file_bytes": size, "tokens": n_tokens, "seq": args.seq,
                          "batch": args.batch, "write_s": round(write_s, 1), "vocab_scan_s": round(scan_s, 1),
                          "cold": cold, "warm": warm, "peak_rss_bytes": peak, "target_rss_bytes": TARGET_RSS_BYTES,
                          "ok": ok}))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
