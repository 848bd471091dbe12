#!/usr/bin/env bash
# One device call on 4 GPUs (issue 29): context parallelism at 4 GPUs, dense CP (diffusers, cuDNN) vs skip lists at
# density 0.5, Ulysses x4, ring x4 and Ulysses 2 x ring 2, against 1 GPU (rank 0's), for the Wan2.1-14B shape
# (40 x 128 heads, 75600 tokens, 4 layers), the Wan2.1-1.3B shape (32760 tokens, 30 layers) and, if the time
# budget allows, HunyuanVideo-sized attention (24 x 128 heads, 118800 tokens, 2 layers).
#
# Device command (kind nvidia-h100-x4; the diffusers 0.42.1 wheel carried under .whl/):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/multi_gpu_x4.sh
# Also runs alone (`bash benchmarks/multi_gpu_x4.sh`): it installs the wheels itself when diffusers is missing.
#
# Expected: ~4 min (imports and NCCL start ~1 min, Triton compiles ~1 min, wan14b ~1.5 min, wan1.3b ~0.5 min,
# hunyuan ~0.5 min). No new shape or mode starts after BUDGET_S (default 300 s) of the benchmark; `timeout` stops
# it at 530 s. The JSON (h100x4-parallel-step.json) is rewritten after every mode, so a cut run keeps what ran.
# Env: QUICK=1 (fewer layers, 2 reps), SHAPES (default wan14b,wan1.3b,hunyuan), MODES (default
# ulysses,ring,unified), BUDGET_S, NPROC (default 4), EXTRA (more arguments; CPU smoke of this script:
# EXTRA=--cpu SHAPES=tiny bash benchmarks/multi_gpu_x4.sh).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# NVLink multicast stays off (KINDS.md): these are already set on the device machines; set again for torchrun.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
if ! python3 -c "import diffusers" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
case ":$PYTHONPATH:" in *":$PWD:"*) ;; *) export PYTHONPATH=$PYTHONPATH:$PWD ;; esac
nvidia-smi -L || true
python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__, 'gpus', torch.cuda.device_count())"
QUICK_FLAG=""; [ "${QUICK:-0}" = 1 ] && QUICK_FLAG="--quick"
timeout 530 python3 -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-4}" \
  benchmarks/bench_parallel_step.py --shape "${SHAPES:-wan14b,wan1.3b,hunyuan}" --modes "${MODES:-ulysses,ring,unified}" \
  --density 0.5 --budget-s "${BUDGET_S:-300}" --timeout-s 300 $QUICK_FLAG ${EXTRA:-} --out "$OUT" 2>&1 \
  | tee "$OUT/parallel-step-x${NPROC:-4}.log" \
  | grep -v -i "warn\|experimental\|wait_tensor\|before the output\|c10d_functional\|kept in float32\|kv_buffer\|allow_inflight"
rc=${PIPESTATUS[0]}
echo "torchrun exit $rc"; ls -la "$OUT"
exit "$rc"
