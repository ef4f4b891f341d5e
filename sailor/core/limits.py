"""Bounds beyond any real job: inputs past them are refused as bad input, so that no value a user can
type makes a command plan, simulate or start processes without end.

Each bound is far above what the largest published training runs use (the figure it is compared
with is cited next to it), and each keeps the work a command does bounded: the planner's and the
simulator's loops run over layers, micro-batches, GPUs and stages, so a global batch of 10^9, a
block count of 10^6 or a node of 10^6 GPUs would otherwise run for minutes or forever. The readers
(`sailor.specs`, `sailor.plan`, `sailor.launch.hosts`, `sailor.elastic.availability`, the profile
and network importers) apply them through the helpers of `sailor.core.fileio`.
"""

from __future__ import annotations

import os

# Samples per global batch. Largest published: 65,536 (BERT pre-training with LAMB, You et al.,
# "Large Batch Optimization for Deep Learning", ICLR 2020); LLM runs use 1-16 K samples (GPT-3 175B:
# 1,536; Llama 3 405B: 16 M tokens = 2,048 samples of 8,192). The planner's and simulator's work grow
# with the micro-batches per pipeline (`benchmarks/bad_input_counts.py` times the largest accepted).
from sailor.core.units import HOUR_S

MAX_GLOBAL_BATCH = 65_536

# Tokens per sample. Longest published training contexts are 1-10 M tokens (Gemini 1.5, Llama 4
# Scout's 10 M); 2^24 = 16.8 M.
MAX_SEQUENCE_LENGTH = 2**24

# Transformer blocks. Largest published: 128 (Megatron-LM's 1 T-parameter configuration, Narayanan et
# al. SC'21 Table 1); GPT-3 175B has 96, PaLM 540B 118.
MAX_BLOCKS = 1024

# Widths: hidden size, MLP width, attention heads, vocabulary. Largest published: hidden 25,600
# (Megatron 1 T), MLP 4 x that, 160 heads, vocabulary 256 K (Gemma). 2^22 = 4.2 M covers all of them.
MAX_WIDTH = 2**22

# GPUs of one type in one zone (a cluster spec's or a trace's count). The largest single clusters
# built hold 100-200 K GPUs (xAI Colossus, 2024-25); 2^17 = 131,072 in one zone and of one type.
MAX_GPUS_PER_ZONE = 2**17

# GPUs in one node (TP never crosses a node). Largest NVLink domain announced: 576 GPUs (NVIDIA
# Vera Rubin NVL576); an 8-GPU server is the common case.
MAX_GPUS_PER_NODE = 1024

# $/GPU-hour. On-demand list prices are $0.3-$15 per GPU-hour (GCP, AWS, Azure price pages, 2025);
# a price above $10,000 is a typo (cents, or $ per month).
MAX_PRICE_USD_PER_GPU_HOUR = 1e4

# Seconds of one layer's forward or backward pass, an optimizer step or a link's latency: a week.
# No measured layer takes more than seconds; larger values only make every prediction meaningless.
MAX_SECONDS = 7 * 24 * HOUR_S

# Bytes/s of a link: 1 byte/s to 10^15 (1 PB/s; NVLink 5 is 1.8 TB/s per GPU). Outside it a transfer
# time is 0 or overflows.
MIN_BANDWIDTH_BYTES_PER_S = 1.0
MAX_BANDWIDTH_BYTES_PER_S = 1e15

# Bytes of a measured activation or memory figure: 2^50 (1 PiB); GPUs hold at most 192 GB (B200).
MAX_BYTES = 2.0**50

# Micro-batch x stage tasks the 1F1B event simulation runs for one pipeline per iteration. 2^20 tasks
# (16 stages x 65,536 micro-batches) take 3.8 s of CPU and 530 MB on our build machines
# (`benchmarks/bad_input_counts.py`); a real plan has far fewer (Megatron 1 T: 64 stages x 512
# micro-batches = 2^15).
# The planner's plans stay under it (16 stages x MAX_GLOBAL_BATCH micro-batches at most, with its
# default --max-stages).
MAX_PIPELINE_TASKS = 2**20

# Points in an availability trace. The public Sailor traces hold 208 points (3.6 hours at 63 s);
# 2^16 points is 45 days at one a minute. `sailor replay` plans once per distinct availability.
MAX_TRACE_POINTS = 2**16

# Seconds of a trace's time stamps and a replay's --duration-s: Unix time is 1.7e9 s now; 1e12 s is
# 30,000 years.
MAX_TRACE_TIME_S = 1e12

# Measurement passes of `sailor profile` (--warmup, --repeats): a median of 10 is the default.
MAX_PROFILE_PASSES = 10_000

# Micro-batch sizes `sailor profile` measures: the planner tries up to 32 (PlanOptions.max_mbs) and
# the public Sailor profiles go to 128.
MAX_PROFILE_MBS = 1024

# Bytes of one input file (spec, plan, trace, profile, network file). The largest public Sailor
# file is 617 kB (profiles_tmp.json).
MAX_FILE_BYTES = 64 * 2**20
# Bytes of one YAML input (job, cluster, hosts, testbed): a large cluster's hosts file is tens of kB.
# YAML is slow to read (libyaml's parser still calls Python for every value: about 1 s per MiB of
# small values here), so a larger file is refused before it is read; big data is JSON.
MAX_YAML_BYTES = 2**20


def max_local_processes() -> int:
    """Processes a command may start on this machine (`sailor train` and `sailor run` on the local
    provider, `sailor profile`): 4 per CPU core, at least 16. Each is a Python process with torch
    (hundreds of MB), so more than a few per core only thrashes the machine."""
    return max(16, 4 * (os.cpu_count() or 1))


def available_memory_bytes() -> int | None:
    """Memory this machine can give new processes without swapping (bytes): /proc/meminfo's
    MemAvailable (Linux), else free physical pages (`os.sysconf`); None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None

# Optimizer steps one `sailor train` or `sailor run` asks for: 10^9 steps of a global batch of even 1
# sample is far beyond any training run (Llama 3 405B: about 1.2M steps), and the step counter stays
# an exact integer everywhere (checkpoint names, metrics).
MAX_STEPS = 10**9

# Input files (`sailor.core.fileio`)
MAX_DEPTH = 32  # nesting levels; our deepest format (Sailor's network fits) uses 8
MAX_NODES = 2**21  # values in one file, aliases counted each time; profiles_tmp.json holds 26 K
MAX_INT_DIGITS = 100  # digits of an integer literal (Python refuses to convert more than 4300)
