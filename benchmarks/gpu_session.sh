#!/usr/bin/env bash
# Everything the GPU issue needs proven on a lent H100/H200, in one device call (about 15 minutes):
#   run from the repo root on the device machine:  bash benchmarks/gpu_session.sh
# Logs go to $OUT (or ./gpu-logs); the last lines printed are the summary table.
set -u
OUT=${OUT:-./gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=python3
step() { echo; echo "=== $1"; }

step "machine" | tee "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/summary.txt"

step "install (no registry there: no build isolation, no deps)"
$py -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { echo "install failed"; tail "$OUT/install.log"; exit 1; }

step "kernel tests compiled on the GPU" | tee -a "$OUT/summary.txt"
$py -m pytest tests/test_kernels_attention.py tests/test_kernels_fused.py tests/test_kernels_compile.py -q -p no:cacheprovider \
    > "$OUT/kernel_tests.log" 2>&1; tail -1 "$OUT/kernel_tests.log" | tee -a "$OUT/summary.txt"

step "greedy float32 parity with HF on the GPU" | tee -a "$OUT/summary.txt"
timeout 300 $py benchmarks/gpu_parity.py > "$OUT/parity.log" 2>&1; tail -1 "$OUT/parity.log" | tee -a "$OUT/summary.txt"

step "kernel benchmarks (decode attention vs copy bandwidth; fused kernels vs eager)" | tee -a "$OUT/summary.txt"
timeout 240 $py benchmarks/bench_kernels.py --out "$OUT/kernels.txt" > "$OUT/bench_kernels.log" 2>&1; tail -25 "$OUT/bench_kernels.log" | tee -a "$OUT/summary.txt"

step "end to end: nano-vllm workload, Qwen3-0.6B shape (random weights), bf16, vs HF continuous batching" | tee -a "$OUT/summary.txt"
$py - <<'PY' > "$OUT/make_model.log" 2>&1
import torch, transformers
from cbatch.model.presets import preset_config
cfg = preset_config("qwen3-0.6b")
cfg.pop("architectures"); cfg.pop("torch_dtype", None)
config = transformers.Qwen3Config(**cfg)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained("/tmp/qwen3-0.6b-random")
print("saved")
PY
timeout 900 $py benchmarks/compare_peers.py --device cuda --dtype bfloat16 --model /tmp/qwen3-0.6b-random \
    --num-requests 256 --prompt-len 100,1024 --output-len 100,1024 --engines cbatch,hf-cb --repeats 1 \
    --engine-arg cbatch:max_num_seqs=256 --engine-arg cbatch:max_num_batched_tokens=8192 --engine-arg cbatch:max_model_len=2048 \
    --json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1; tail -12 "$OUT/e2e.log" | tee -a "$OUT/summary.txt"

step "summary"; cat "$OUT/summary.txt"
