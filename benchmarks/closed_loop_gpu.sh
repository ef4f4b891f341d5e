#!/usr/bin/env bash
# Closed loop on one GPU (issue 6, item 5): profile, simulate and train single-GPU plans over a
# micro-batch sweep for two model sizes; target mean absolute error <= 5 %. Each model prints a
# table and, last, one JSON line (benchmarks/closed_loop.py --single-device); all lines are also kept
# in $OUT/closed_loop_gpu.jsonl. Needs one CUDA device in the GPU catalog (e.g. H200 -> H200-141).
# Sized for about 8 minutes on an H100/H200; nothing is recorded in the README unless this ran.
#
#   OUT=/tmp/gpu-loop bash benchmarks/closed_loop_gpu.sh
set -euo pipefail
OUT=${OUT:-/tmp/sailor-closed-loop-gpu}
mkdir -p "$OUT"
: > "$OUT/closed_loop_gpu.jsonl"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
# model  sequence  global batch  micro-batch sweep
while read -r model seq gbs sweep; do
  python benchmarks/closed_loop.py --device cuda --single-device --model "$model" --seq "$seq" \
      --gbs "$gbs" --mbs "$sweep" --steps 6 --skip 2 --repeats 10 --out "$OUT/$model" \
    | tee "$OUT/$model.txt" | tail -n 1 >> "$OUT/closed_loop_gpu.jsonl"
  cat "$OUT/$model.txt"
done <<'MODELS'
opt-350m 512 32 1,2,4,8
gpt-neo-2.7b 512 16 1,2,4
MODELS
python - "$OUT/closed_loop_gpu.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
errs = [abs(r["error_pct"]) for d in rows for r in d["rows"]]
print(json.dumps({"mean_abs_error_pct": sum(errs) / len(errs), "plans": len(errs),
                  "per_model": {d["model"]: d["mean_abs_error_pct"] for d in rows}}))
PY
