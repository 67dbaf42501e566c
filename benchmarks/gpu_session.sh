#!/usr/bin/env bash
# The GPU kit: what the GPU issue needs proven and measured on a lent H100/H200, in parts that each fit one
# device call (the device kills a command after 600 s: every part plans <= 540 s, every step runs under its
# own `timeout`, and each part installs what it needs, so parts run in any order on a fresh or warm machine).
#
#   bash benchmarks/gpu_session.sh PART        PART: all | speed | peer | kernels | suite | parity | bench | e2e | e2e-more | e2e-sync | int4 | lora
#   bash benchmarks/gpu_session.sh --list      the parts, their steps and time budgets
#   bash benchmarks/gpu_session.sh --cpu-dry-run [PART...]   every part (or those named) on this CPU (Triton interpreter, tiny shapes,
#                                              a few requests): the same files and summary, to catch shell
#                                              and plumbing mistakes before a lease is spent on them
#
# What comes back ($OUT, or ./gpu-logs): summary.txt (each part appends its section: the machine, the stack,
# every step's exit code, time and last lines) and PART-logs.tgz (that part's full logs and JSON); at most
# 1 + 7 files (the limit is 8), two folders deep at most. cbatch's figures are printed and written before any peer runs.
#
# Expected device time per part (budgets are the timeouts): kernels ~4 min, suite ~4, parity ~3, bench ~3,
# e2e ~5, e2e-more ~5, e2e-sync ~3 (e2e with --no-async-scheduling: the overlap's gain), int4 ~7 (the W4A16 GEMM
# against bf16 matmul on 70B shapes, and e2e's workload on an AWQ-g128 copy of the model: its tok/s against
# e2e's), lora ~3 (4 adapters x 128 rows + 128 base rows against the base model alone, grouped and ungrouped,
# the Triton shrink/expand kernels). The GPU issue's order: kernels, suite, parity, e2e, bench, e2e-more, e2e-sync;
# then int4, lora.
#
# Carry (device tool `carry`): .carry (SmolLM2's tokenizer for the CLI tests; `python benchmarks/make_carry.py`
# builds it) and .whl (wheels of what the image lacks: xgrammar and the structured-output tests' packages; make_carry.py
# downloads them). No package registry is used.
set -u
set -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu-logs}
DRY=0
PART_LIMIT_S=540
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ---- the plan: PART -> "step:budget_s ..." --------------------------------------------------------------
declare -A PLAN=(
  [kernels]="compile_check:120 kernel_tests:390"
  [suite]="suite_tests:510"
  [parity]="gpu_parity:330 fp8_accuracy:180"
  [bench]="bench_kernels:480"
  [e2e]="make_model:90 greedy_vs_hf:420"
  [e2e-more]="make_model:90 cbatch_temp06:210 cbatch_fp8:210"
  [e2e-sync]="make_model:90 cbatch_sync:210"
  [int4]="make_model:60 make_int4:120 w4a16_gemm:120 cbatch_int4:210"
  [lora]="lora_bench:300"
  [speed]="make_model:60 profile_bf16:100 profile_fp8:70 decode_kernels:110"
  [peer]="make_model:60 hf_vs_cbatch:150"
  [gpu-tests]="gpu_tests:150"
  [all]="make_model:40 profile_bf16:90 profile_fp8:60 decode_kernels:110 hf_vs_cbatch:120"
)
PARTS="all speed peer gpu-tests kernels suite parity bench e2e e2e-more e2e-sync int4 lora"
ALL_LIMIT_S=420  # the GPU issue: `all` in at most 7 minutes
KERNEL_TESTS="tests/test_kernels_attention.py tests/test_kernels_fused.py tests/test_kernels_sampler.py tests/test_fp32_logits.py tests/test_kernels_compile.py tests/test_compile_count.py tests/test_triton_e2e.py tests/test_fp8_kv.py"
MODEL=/tmp/qwen3-0.6b-random

plan_of() { echo "${PLAN[$1]}"; }
budget_total() { local t=0 s; for s in $(plan_of "$1"); do t=$((t + ${s#*:})); done; echo $t; }

print_plan() {
  local part=$1 s
  echo "part $part: $(for s in $(plan_of "$part"); do printf '%s %ss, ' "${s%%:*}" "${s#*:}"; done)total $(budget_total "$part") s (limit $PART_LIMIT_S s)"
}

# ---- one step: its own timeout, its own log, a line in the summary ---------------------------------------
step() {  # step NAME CMD...   (budget from the plan; dry runs get the same budget)
  local name=$1; shift
  local budget
  budget=$(for s in $(plan_of "$PART"); do [ "${s%%:*}" = "$name" ] && echo "${s#*:}"; done)
  [ -n "$budget" ] || { echo "BUG: step $name is not in part $PART's plan" | tee -a "$SUMMARY"; return 1; }
  echo; echo "=== $PART/$name (budget ${budget} s): $*"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$budget" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  local took=$((SECONDS - t0)) verdict=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT"
  [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED (exit $rc)"
  {
    echo "--- $PART/$name: $verdict in ${took} s of ${budget} s"
    grep -E '^run [0-9]+/' "$LOGS/$name.log" | cut -c1-400  # compare_peers: each engine's figures, cbatch first
    case $name in  # the profiles' and kernel tables' figures whole, the rest's last lines
      profile_*|decode_kernels|w4a16_gemm) grep -v -E '^(USDT|STAGE|\[W)' "$LOGS/$name.log" | tail -n 90 | cut -c1-220 ;;
      *) tail -n "${TAIL_LINES:-12}" "$LOGS/$name.log" | cut -c1-220 ;;
    esac
  } | tee -a "$SUMMARY"
  FAILED=$((FAILED + (rc != 0)))
  return 0
}

setup() {  # the stack, the carried wheels and tokenizer; nothing comes from a registry
  {
    echo; echo "##### part $PART $( [ $DRY = 1 ] && echo '(CPU dry run: interpreter, tiny shapes)')  $(date -u +%FT%TZ)"
    print_plan "$PART"
    if command -v nvidia-smi >/dev/null && [ $DRY = 0 ]; then
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    fi
    $py -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available())"
  } 2>&1 | tee -a "$SUMMARY"
  if ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  [ -f .carry/smollm2-tokenizer/tokenizer.json ] && export CBATCH_TEST_TOKENIZER_DIR="$ROOT/.carry/smollm2-tokenizer"
  local missing
  missing=$($py -c "
import importlib.util as u
need = ['torch', 'triton', 'transformers', 'safetensors', 'typer', 'pyarrow', 'rich', 'tqdm', 'numpy', 'pytest', 'hypothesis', 'xgrammar', 'jsonschema']
print(' '.join(n for n in need if u.find_spec(n) is None))")
  [ -n "$missing" ] && echo "missing packages (carry them as wheels in .whl): $missing" | tee -a "$SUMMARY"
  return 0
}

finish() {
  tar czf "$OUT/$PART-logs.tgz" -C "$LOGS" . 2>/dev/null
  echo "--- part $PART: $FAILED step(s) failed; logs in $PART-logs.tgz" | tee -a "$SUMMARY"
  rm -rf "$LOGS"
}

model_dir() { [ $DRY = 1 ] && echo /tmp/cbatch-dry-model || echo "$MODEL"; }
model_preset() { [ $DRY = 1 ] && echo tiny || echo qwen3-0.6b; }

e2e_args() {  # the nano-vllm workload (dry: a handful of short requests on the tiny model, CPU)
  if [ $DRY = 1 ]; then
    echo "--device cpu --dtype float32 --model $(model_dir) --num-requests 4 --prompt-len 8,24 --output-len 4,8 --repeats 1 --threads 2 --engine-arg cbatch:attention_backend=triton"
  else
    echo "--device cuda --dtype bfloat16 --model $MODEL --num-requests 256 --prompt-len 100,1024 --output-len 100,1024 --repeats 1 --engine-arg cbatch:max_model_len=2048"
  fi
}

profile_args() {  # gpu_profile.py on the nano-vllm workload (dry: the tiny model, a few requests, CPU)
  if [ $DRY = 1 ]; then
    echo "--device cpu --dtype float32 --model $(model_dir) --num-requests 6 --prompt-len 8,24 --output-len 4,12 --profile-steps 3 --profile-batch 6 --engine-arg attention_backend=triton"
  else
    echo "--device cuda --dtype bfloat16 --model $MODEL --num-requests 256 --prompt-len 100,1024 --output-len 100,1024 --engine-arg max_model_len=2048"
  fi
}

# ---- the parts ---------------------------------------------------------------------------------------------
# speed: where the e2e run's time goes (per step class against its bandwidth floor, kernel profiles of the first
# prompt-chunk steps and of steady decode steps), bf16 and fp8 KV, and the decode attention kernel's bandwidth
# and tile sweep.
part_speed() {
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step profile_bf16 $py benchmarks/gpu_profile.py $(profile_args) --temperatures 0,0.6 --json "$OUT/profile_bf16.json" --trace "$LOGS/trace_bf16.json.gz"
  step profile_fp8 $py benchmarks/gpu_profile.py $(profile_args) --engine-arg kv_cache_dtype=fp8 --profile-steps 10 --json "$OUT/profile_fp8.json"
  step decode_kernels $py benchmarks/bench_kernels.py $( [ $DRY = 1 ] && echo --cpu-smoke ) --quick --no-fused --sweep-decode-tiles --out "$LOGS/decode_kernels.txt"
}

# peer: transformers' continuous batching against cbatch on 64 of the workload's requests (HF CB could not
# finish 256 in 200 s on an H200 before it was configured; 64 took it 58 s after: a ratio always comes back).
part_peer() {
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step hf_vs_cbatch $py benchmarks/compare_peers.py $(e2e_args | sed 's/--num-requests [0-9]*/--num-requests '"$( [ $DRY = 1 ] && echo 4 || echo 64)"'/') --engines cbatch,hf-cb --run-timeout 120 --json "$LOGS/hf_vs_cbatch.json"
}

# gpu-tests: the kernel tests (no engines: each test's GPU memory is small, so 4 xdist workers share the card)
# and the GPU-only engine tests, counted (passed / failed / skipped) in the summary
GPU_TESTS="tests/test_kernels_fused.py tests/test_kernels_attention.py tests/test_kernels_sampler.py tests/test_fp32_logits.py tests/test_async_scheduling.py::test_a_steps_tokens_wait_for_that_step_alone"
part_gpu_tests() {
  if [ $DRY = 1 ]; then
    step gpu_tests $py -m pytest -p no:cacheprovider -rfE tests/test_kernels_fused.py -k "rotary and dtype0" tests/test_async_scheduling.py::test_a_steps_tokens_wait_for_that_step_alone
  else
    step gpu_tests $py -m pytest -p no:cacheprovider -rfE -n 4 $GPU_TESTS
  fi
}

# all: both, in one call of at most 7 minutes
part_all() {
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step profile_bf16 $py benchmarks/gpu_profile.py $(profile_args) --temperatures 0,0.6 --json "$OUT/profile_bf16.json" --trace "$LOGS/trace_bf16.json.gz"
  step profile_fp8 $py benchmarks/gpu_profile.py $(profile_args) --engine-arg kv_cache_dtype=fp8 --profile-steps 10 --json "$OUT/profile_fp8.json"
  step decode_kernels $py benchmarks/bench_kernels.py $( [ $DRY = 1 ] && echo --cpu-smoke ) --quick --no-fused --sweep-decode-tiles --out "$LOGS/decode_kernels.txt"
  step hf_vs_cbatch $py benchmarks/compare_peers.py $(e2e_args | sed 's/--num-requests [0-9]*/--num-requests '"$( [ $DRY = 1 ] && echo 4 || echo 64)"'/') --engines cbatch,hf-cb --run-timeout 100 --json "$LOGS/hf_vs_cbatch.json"
}

part_kernels() {
  if [ $DRY = 1 ]; then
    step compile_check $py -c "print('offline sm_90 compile: tests/test_kernels_compile.py runs it in the suite')"
    step kernel_tests $py -m pytest -p no:cacheprovider -rfE tests/test_kernels_fused.py -k "norm_rope_store and dtype0 or fused_sample" tests/test_compile_count.py
  else
    step compile_check $py -m cbatch.kernels._compile_check 90
    step kernel_tests $py -m pytest -p no:cacheprovider -rfE $KERNEL_TESTS
  fi
}

part_suite() {
  local ignore="" f
  for f in $KERNEL_TESTS; do ignore="$ignore --ignore=$f"; done
  if [ $DRY = 1 ]; then
    step suite_tests $py -m pytest -p no:cacheprovider -rfE tests/test_gpu_defaults.py tests/test_cli_run.py -k "limits or same_outputs"
  else
    step suite_tests $py -m pytest -p no:cacheprovider -rfE tests $ignore
  fi
}

part_parity() {
  if [ $DRY = 1 ]; then
    step gpu_parity $py benchmarks/gpu_parity.py --cpu-dry-run
    step fp8_accuracy $py benchmarks/fp8_kv_accuracy.py --arch qwen3 --num-prompts 2 --max-tokens 4 --max-prompt 12 --dtype float32
  else
    step gpu_parity $py benchmarks/gpu_parity.py
    step fp8_accuracy $py benchmarks/fp8_kv_accuracy.py --device cuda --backend triton --dtype bfloat16
  fi
}

part_bench() {
  if [ $DRY = 1 ]; then
    step bench_kernels $py benchmarks/bench_kernels.py --cpu-smoke --out "$LOGS/kernels.txt"
  else
    step bench_kernels $py benchmarks/bench_kernels.py --out "$LOGS/kernels.txt"
  fi
}

part_e2e() {  # cbatch first (its figures printed and in e2e.json the moment it ends), then the peer, guarded
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step greedy_vs_hf $py benchmarks/compare_peers.py $(e2e_args) --engines cbatch,hf-cb --run-timeout 200 --json "$LOGS/e2e.json"
}

part_e2e_more() {
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step cbatch_temp06 $py benchmarks/compare_peers.py $(e2e_args) --engines cbatch --temperature 0.6 --run-timeout 200 --json "$LOGS/e2e_temp06.json"
  step cbatch_fp8 $py benchmarks/compare_peers.py $(e2e_args) --engines cbatch --engine-arg cbatch:kv_cache_dtype=fp8 --run-timeout 200 --json "$LOGS/e2e_fp8.json"
}

part_e2e_sync() {  # the e2e workload with asynchronous scheduling off: its gain is e2e's tok/s over this one's
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step cbatch_sync $py benchmarks/compare_peers.py $(e2e_args) --engines cbatch --engine-arg cbatch:async_scheduling=false --run-timeout 200 --json "$LOGS/e2e_sync.json"
}

part_int4() {  # 4-bit weights: the GEMM against bf16 matmul, then e2e's workload on an AWQ-g128 copy (cbatch alone)
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step make_int4 $py tests/int_checkpoints.py "$(model_dir)" "$(model_dir)-awq-g128" awq-g128
  step w4a16_gemm $py benchmarks/w4a16_gemm.py $( [ $DRY = 1 ] && echo --cpu-smoke ) --out "$LOGS/w4a16_gemm.txt"
  step cbatch_int4 $py benchmarks/compare_peers.py $(e2e_args | sed "s#--model [^ ]*#--model $(model_dir)-awq-g128#") --engines cbatch --run-timeout 200 --json "$LOGS/e2e_int4.json"
}

part_lora() {  # LoRA adapters per row (issue 36): 4 adapters x rows + base rows against the base model alone, grouped and not
  if [ $DRY = 1 ]; then
    step lora_bench $py benchmarks/lora_bench.py --rows 4 --prompt-len 8:16 --output-len 4 --rounds 1 --hidden 64 --layers 2 --vocab 512
  else
    step lora_bench $py benchmarks/lora_bench.py --device cuda --hidden 1024 --layers 8 --rows 128 --prompt-len 128:512 \
      --output-len 128 --max-num-seqs 256 --rounds 3
  fi
}

run_part() {
  PART=$1
  [ -n "${PLAN[$PART]:-}" ] || { echo "unknown part '$PART'; parts: $PARTS" >&2; return 2; }
  [ "$PART" != all ] || [ "$(budget_total all)" -le $ALL_LIMIT_S ] || { echo "BUG: part all plans $(budget_total all) s > $ALL_LIMIT_S s" >&2; return 2; }
  [ "$(budget_total "$PART")" -le $PART_LIMIT_S ] || { echo "BUG: part $PART plans $(budget_total "$PART") s > $PART_LIMIT_S s" >&2; return 2; }
  LOGS=$(mktemp -d "${TMPDIR:-/tmp}/cbatch-$PART-XXXX")
  FAILED=0
  setup
  "part_${PART//-/_}"
  finish
}

main() {
  mkdir -p "$OUT"
  SUMMARY=$OUT/summary.txt
  case "${1:-}" in
    --list) for p in $PARTS; do print_plan "$p"; done ;;
    --cpu-dry-run)
      DRY=1
      export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
      local p total=0
      shift
      for p in ${*:-$PARTS}; do run_part "$p" || total=$((total + 1)); done
      # one archive for every part's logs (a device call brings back at most 8 files; a real call runs 1-2 parts)
      (cd "$OUT" && tar cf dry-run-logs.tar ./*-logs.tgz && rm -f ./*-logs.tgz)
      local files
      files=$(find "$OUT" -type f | wc -l)
      echo "dry run: $total part(s) failed to run; $files file(s) in $OUT (limit 8)" | tee -a "$SUMMARY"
      [ "$total" -eq 0 ] && [ "$files" -le 8 ] && ! grep -q -E "FAILED|TIMED OUT" "$SUMMARY" ;;
    "") echo "usage: $0 PART | --list | --cpu-dry-run   (parts: $PARTS)" >&2; return 2 ;;
    *) run_part "$1" || return $?; echo; cat "$SUMMARY" ;;
  esac
}

main "$@"
