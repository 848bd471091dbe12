#!/usr/bin/env bash
# One device call on 2 GPUs (issue #9): context-parallel step benchmark (1 GPU vs Ulysses vs ring, outputs
# compared with the 1-GPU patched run), then the video fine-tune with skip-train on 1 GPU (batch 4) and on 2 GPUs
# with accelerate (batch 2 per process: the same global batch, the same noise; see finetune_video.py).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
STEPS=${STEPS:-50}
torchrun --standalone --nproc-per-node 2 benchmarks/bench_parallel_step.py --shape wan1.3b,wan14b --out "$OUT" 2>&1 \
  | tee "$OUT/parallel-step.log" | grep -v -i "warn\|experimental\|wait_tensor\|before the output\|c10d_functional\|kept in float32\|kv_buffer\|allow_inflight" | tail -24
for n in 1 2; do
  multi=""; [ "$n" -gt 1 ] && multi="--multi_gpu"
  accelerate launch $multi --num_processes "$n" --num_machines 1 --mixed_precision bf16 --dynamo_backend no \
    -m sparsepatch.recipes.finetune_video --config skip-train --model-size base --max-steps "$STEPS" --tile 64 64 \
    --frames 5 --latent-size 32 --batch-size $((4 / n)) --log-every 10 2>&1 | grep -E "SUMMARY|^step|Error|error" \
    | tee "$OUT/finetune-skip-train-x$n.log"
done
python3 - "$OUT" <<'PY'
import json, sys
runs = {}
for n in (1, 2):
    for line in open(f"{sys.argv[1]}/finetune-skip-train-x{n}.log"):
        if line.startswith("SUMMARY "):
            runs[n] = json.loads(line[8:])
if len(runs) == 2:
    a, b = runs[1]["losses"], runs[2]["losses"]
    tail = lambda x: sum(x[-10:]) / len(x[-10:])
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(f"fine-tune 1 GPU x batch 4 vs 2 GPUs x batch 2: final {a[-1]:.5f} vs {b[-1]:.5f}, "
          f"last-10 mean {tail(a):.5f} vs {tail(b):.5f} ({abs(tail(a) - tail(b)) / tail(a):.2%}), "
          f"worst per-step rel diff {worst:.2%}; mean step ms {1e3 * sum(runs[1]['step_times'][1:]) / (len(a) - 1):.1f}"
          f" vs {1e3 * sum(runs[2]['step_times'][1:]) / (len(b) - 1):.1f}")
    json.dump(runs, open(f"{sys.argv[1]}/finetune-x1-vs-x2.json", "w"))
PY
