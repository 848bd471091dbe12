#!/usr/bin/env bash
# One device call: every @pytest.mark.gpu test, the training-mode benchmark, and the 200-step video fine-tune
# dense vs skip-train (bf16 autocast, head_dim 64 so attention runs on the Triton kernels). Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
for f in tests/test_*.py; do   # one process per file (see Makefile test-gpu)
  python3 -m pytest -q -m gpu "$f" -p no:cacheprovider 2>&1 | tail -5
done | tee "$OUT/gpu-tests.log"
python3 benchmarks/bench_training_mode.py --out "$OUT" 2>&1 | tail -12 | tee "$OUT/training-mode.log"
for cfg in dense skip-train; do
  accelerate launch --num_processes 1 --num_machines 1 --mixed_precision bf16 --dynamo_backend no \
    -m sparsepatch.recipes.finetune_video --config "$cfg" --model-size base --max-steps 200 --tile 64 64 \
    --frames 5 --latent-size 32 --batch-size 4 --log-every 50 2>&1 | grep -E "SUMMARY|step 200|Error|error" \
    | tee "$OUT/finetune-$cfg.log"
done
