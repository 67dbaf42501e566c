#!/usr/bin/env bash
# The GPU kit: what the GPU issue needs proven and measured on a lent H100/H200, in parts that each fit one
# device call (the device kills a command after 600 s: every part plans <= 540 s in the worst case, a reserve of
# >= 60 s; the worst case counts setup, every step's budget, its kill grace and its logs' archive; every step runs
# under its own `timeout`, and each part installs what it needs, so parts run in any order on a fresh or warm
# machine).
#
#   bash benchmarks/gpu_session.sh PART        PART: all | speed | peer | gpu-tests | kernels | suite | parity | bench | e2e | e2e-more | e2e-sync | e2e-split | e2e-gemm | int4 | lora | vision | spec
#   bash benchmarks/gpu_session.sh --list      the parts, their steps, time budgets and worst cases
#   bash benchmarks/gpu_session.sh --cpu-dry-run [PART...]   every part (or those named) on this CPU (Triton interpreter, tiny shapes,
#                                              a few requests): the same files and summary, to catch shell
#                                              and plumbing mistakes before a lease is spent on them; its
#                                              timeouts are the plan's x KIT_DRY_SCALE (default 4): they catch
#                                              hangs, not the GPU's timing, on a CPU that may be shared
#   KIT_INJECT_FAILURE=PIECE ... all           the first step's probe sees PIECE fail (benchmarks/first_step.py
#                                              --fail): the dry run of the switch-off, end to end
#
# What comes back ($OUT, or ./gpu-logs): summary.txt (each part appends its section: the machine, the stack,
# every step's exit code, time and last lines, written as each step ends), PART-logs.tgz (that part's full logs,
# re-archived as each step ends) and the figures' JSON, each rewritten as soon as a figure is in (the profiles,
# the first step, the peer comparison): a step or a call killed later loses nothing before it. At most 8 files,
# two folders deep at most. cbatch's figures are printed and written before any peer runs.
#
# `all` starts with the first step (benchmarks/first_step.py, ~20 s): a two-layer engine with Qwen3-0.6B's
# shapes runs start-up tuning, CUDA graphs, float32 logits and the split sampler; a piece that fails there is
# named and switched off (its engine setting) for every later step of the call. It also leaves the compiled
# kernels and the tuning cache the later steps read.
#
# Expected device time per part (budgets are the timeouts): kernels ~4 min, suite ~4, parity ~3, bench ~3,
# e2e ~5, e2e-more ~5, e2e-sync ~3 (e2e with --no-async-scheduling: the overlap's gain), e2e-split ~3 (e2e with
# --no-split-kv: the split-KV policy's gain), e2e-gemm ~3 (e2e with --no-decode-gemm: the tuned decode GEMMs' gain), int4 ~7 (the W4A16 GEMM
# against bf16 matmul on 70B shapes, and e2e's workload on an AWQ-g128 copy of the model: its tok/s against
# e2e's), lora ~3 (4 adapters x 128 rows + 128 base rows against the base model alone, grouped and ungrouped,
# the Triton shrink/expand kernels), vision ~8 (images/s and output tok/s of OCR-shaped rows on a random
# Qwen2.5-VL-7B shape, cbatch then transformers). spec ~4 (speculative decoding, issue 51: benchmarks/speculative_bench.py's
# copy-heavy and random workloads on a random Qwen3-0.6B and a looping variant of it, off against auto and ngram in
# one process, tokens compared). The GPU issue's order: kernels, suite, parity, e2e, bench, e2e-more, e2e-sync;
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
# ---- the time plan's one source of truth: a part's worst case is SETUP_S + every step's budget + KILL_AFTER_S
# per step + FINISH_S, and it must stay within its limit (run_part refuses a part that does not)
DEVICE_LIMIT_S=600  # a device command is killed here
RESERVE_S=60        # every part's worst case leaves at least this much before that kill
PART_LIMIT_S=$((DEVICE_LIMIT_S - RESERVE_S))
KILL_AFTER_S=5    # a step past its budget gets SIGTERM, then SIGKILL this much later
ARCHIVE_S=3       # each step's logs re-archived into $OUT as soon as it ends
SETUP_S=25        # the stack's versions and the carried wheels, under their own deadline
FINISH_S=5        # the summary's last line
DRY_SCALE=${KIT_DRY_SCALE:-4}  # a dry run's timeouts, x the plan's
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ---- the plan: PART -> "step:budget_s ..." --------------------------------------------------------------
declare -A PLAN=(
  [kernels]="compile_check:120 kernel_tests:374"
  [suite]="suite_tests:502"
  [parity]="gpu_parity:314 fp8_accuracy:180"
  [bench]="bench_kernels:480"
  [e2e]="make_model:90 greedy_vs_hf:404"
  [e2e-more]="make_model:80 cbatch_temp06:205 cbatch_fp8:199"
  [e2e-sync]="make_model:90 cbatch_sync:210"
  [int4]="make_model:50 make_int4:120 w4a16_gemm:120 cbatch_int4:188"
  [lora]="lora_bench:300"
  [e2e-split]="make_model:90 cbatch_no_split:210"
  [e2e-gemm]="make_model:90 cbatch_no_gemm:210"
  [speed]="make_model:60 profile_bf16:100 profile_fp8:70 decode_kernels:110"
  [peer]="make_model:40 hf_vs_cbatch:450"
  [gpu-tests]="gpu_tests:150"
  [families]="family_kernel_tests:150 mla_decode:120 moe_mxfp4:180"
  [vision]="vision_check:60 vision_cbatch:240 vision_hf:180"
  # two engines (the looping variant, then the random model), each tuned and captured once (~40-60 s), then
  # off / auto / ngram in turn on each workload (a few seconds each at ~20k tok/s); the variant written ~10 s
  [spec]="make_model:70 spec_bench:420"
  # the last step takes what the steps before it left of their budgets too (elastic_budget). profile_fp8 needs
  # ~37-48 s (its own tuning: the fp8 tiles are another key); profile_bf16 starts on the first step's compiled
  # kernels and tuning cache. The peer: cbatch ~20 s and hf-cb ~71 s on 64 requests, before the fallback's reserve.
  [all]="first_step:45 make_model:25 profile_bf16:70 profile_fp8:60 decode_kernels:35 host_step:15 hf_vs_cbatch:204"
)
PARTS="all speed peer gpu-tests families kernels suite parity bench e2e e2e-more e2e-sync e2e-split e2e-gemm int4 lora vision spec"
# the peer comparison (peer_args): hf-cb guarded by what the step's budget leaves before the fallback's reserve,
# and skipped when that is under MIN_PEER_GUARD_S (on an H200, configured, it took 58 s for 64 requests, 71 s of
# process); if it does not finish, both again on FALLBACK_REQUESTS inside the reserve (cbatch ~20 s with its graphs
# capped at the job's rows; hf-cb's time is ~1,000 steps of ~50 ms whatever the count), so a ratio always comes
# back. `all` compares on ALL_PEER_REQUESTS (256 only in the `peer` part, which has the time). The dry run forces
# the fallback.
ALL_PEER_REQUESTS=64
FALLBACK_REQUESTS=32
FALLBACK_RESERVE_S=100
MIN_PEER_GUARD_S=70
# what a step does inside its budget, where that is more than one thing (printed with the plan): PART/STEP
peer_note() { echo "cbatch, then hf-cb, on $1 requests; hf-cb guarded by what is left before the fallback's ${FALLBACK_RESERVE_S} s (skipped under ${MIN_PEER_GUARD_S} s); if it does not finish: both on ${FALLBACK_REQUESTS} requests in those ${FALLBACK_RESERVE_S} s"; }
declare -A STEP_NOTE=(
  [all/first_step]="a two-layer Qwen3-0.6B-shaped engine: tuning, graphs, fp32 logits, split sampler; a failing piece is switched off for the rest of the call"
  [all/profile_bf16]="greedy and temperature 0.6 timed runs, a profile of 20 decode steps"
  [all/profile_fp8]="one timed run, no profile; start-up and tuning written before it"
  [all/decode_kernels]="bf16 and fp8 shapes, 64 x 8192 split and unsplit; no tile sweep (start-up tuning times the candidates)"
  [all/host_step]="CPU only, nothing else running: host_overhead.py --cpu-time at 256 and 1024 sequences"
  [all/hf_vs_cbatch]="$(peer_note "$ALL_PEER_REQUESTS"); also takes what the steps before it left unused"
  [peer/hf_vs_cbatch]="$(peer_note 256)"
  [vision/vision_check]="the vision tower's GPU attention (flash varlen) against SDPA per segment length, and the tower against HF's"
  [vision/vision_cbatch]="64 rows of one ~1,200-token page + ~1,000 output tokens, random Qwen2.5-VL-7B shape; the tower alone on 8 pages"
  [vision/vision_hf]="transformers' batched generate on 16 of those rows, max_time inside the budget"
)
KERNEL_TESTS="tests/test_kernels_attention.py tests/test_kernels_fused.py tests/test_kernels_sampler.py tests/test_kernels_gemm.py tests/test_fp32_logits.py tests/test_kernels_compile.py tests/test_compile_count.py tests/test_triton_e2e.py tests/test_fp8_kv.py"
MODEL=/tmp/qwen3-0.6b-random

plan_of() { echo "${PLAN[$1]}"; }
budget_total() { local t=0 s; for s in $(plan_of "$1"); do t=$((t + ${s#*:})); done; echo $t; }
limit_of() { echo $PART_LIMIT_S; }
steps_in() { plan_of "$1" | wc -w; }
step_extra() { echo $((KILL_AFTER_S + ARCHIVE_S)); }  # past a step's budget: its kill grace and its archive
worst_case() { echo $((SETUP_S + $(budget_total "$1") + $(step_extra) * $(steps_in "$1") + FINISH_S)); }
reserve_of() { echo $((DEVICE_LIMIT_S - $(worst_case "$1"))); }
budget_of() { local s; for s in $(plan_of "$PART"); do [ "${s%%:*}" = "$1" ] && echo "${s#*:}"; done; }
scaled() { [ $DRY = 1 ] && echo $(($1 * DRY_SCALE)) || echo "$1"; }  # a timeout as this run applies it

print_plan() {  # the plan, a line per step, and its worst case against the part's limit
  local part=$1 s name at=$SETUP_S
  echo "part $part: worst case $(worst_case "$part") s of its $(limit_of "$part") s limit, reserve $(reserve_of "$part") s before the device's ${DEVICE_LIMIT_S} s kill (setup, each step's budget + ${KILL_AFTER_S} s kill grace + ${ARCHIVE_S} s archive, finish)"
  printf '  %-16s %4s s  (ends by %3s s)\n' setup "$SETUP_S" "$at"
  for s in $(plan_of "$part"); do
    name=${s%%:*}
    at=$((at + ${s#*:} + $(step_extra)))
    printf '  %-16s %4s s + %s  (ends by %3s s)%s\n' "$name" "${s#*:}" "$(step_extra)" "$at" "${STEP_NOTE[$part/$name]:+  ${STEP_NOTE[$part/$name]}}"
  done
  printf '  %-16s %4s s  (ends by %3s s)\n' archive "$FINISH_S" "$((at + FINISH_S))"
}

elastic_budget() {  # the last step of `all`: its planned budget, or all that the steps before it left unused
  local planned left
  planned=$(budget_of "$1")
  left=$(( $(limit_of "$PART") - (SECONDS - PART_T0) - $(step_extra) - FINISH_S ))
  [ "$left" -gt "$planned" ] && echo "$left" || echo "$planned"
}

# ---- one step: its own timeout, its own log, a line in the summary ---------------------------------------
step() {  # step NAME CMD...   (budget from the plan, or $STEP_BUDGET; a dry run's x DRY_SCALE)
  local name=$1; shift
  local budget
  budget=${STEP_BUDGET:-$(budget_of "$name")}
  [ -n "$budget" ] || { echo "BUG: step $name is not in part $PART's plan" | tee -a "$SUMMARY"; return 1; }
  budget=$(scaled "$budget")
  echo; echo "=== $PART/$name (budget ${budget} s): $*"
  local t0=$SECONDS rc
  timeout --kill-after=$KILL_AFTER_S "$budget" "$@" > "$LOGS/$name.log" 2>&1
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
  archive
  return 0
}

archive() {  # the part's logs so far into $OUT (temp file + rename: a kill mid-archive keeps the last one)
  timeout --kill-after=1 $((ARCHIVE_S - 1)) tar czf "$OUT/.$PART-logs.tgz" -C "$LOGS" . 2>/dev/null \
    && mv "$OUT/.$PART-logs.tgz" "$OUT/$PART-logs.tgz"
  rm -f "$OUT/.$PART-logs.tgz"
}

in_setup() {  # a setup command, killed at setup's deadline (SETUP_END); skipped past it
  local left=$((SETUP_END - SECONDS))
  [ "$left" -gt 0 ] || { echo "setup: past its ${SETUP_S} s, skipped: $1" >&2; return 124; }
  timeout --kill-after=1 "$left" "$@"
}

setup() {  # the stack, the carried wheels and tokenizer; nothing comes from a registry
  SETUP_END=$((SECONDS + SETUP_S - 1))  # - 1: in_setup's kill grace
  {
    echo; echo "##### part $PART $( [ $DRY = 1 ] && echo '(CPU dry run: interpreter, tiny shapes)')  $(date -u +%FT%TZ)"
    print_plan "$PART"
    if command -v nvidia-smi >/dev/null && [ $DRY = 0 ]; then
      in_setup nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    fi
    in_setup $py -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available())"
  } 2>&1 | tee -a "$SUMMARY"
  if ls .whl/*.whl >/dev/null 2>&1; then
    in_setup $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  [ -f .carry/smollm2-tokenizer/tokenizer.json ] && export CBATCH_TEST_TOKENIZER_DIR="$ROOT/.carry/smollm2-tokenizer"
  local missing
  missing=$(in_setup $py -c "
import importlib.util as u
need = ['torch', 'triton', 'transformers', 'safetensors', 'typer', 'pyarrow', 'rich', 'tqdm', 'numpy', 'pytest', 'hypothesis', 'xgrammar', 'jsonschema']
print(' '.join(n for n in need if u.find_spec(n) is None))")
  [ -n "$missing" ] && echo "missing packages (carry them as wheels in .whl): $missing" | tee -a "$SUMMARY"
  echo "setup: $((SECONDS - PART_T0)) s of ${SETUP_S} s" | tee -a "$SUMMARY"
  return 0
}

finish() {  # every step archived its logs as it ended
  echo "--- part $PART: $FAILED step(s) failed; logs in $PART-logs.tgz" | tee -a "$SUMMARY"
  rm -rf "$LOGS"
}

model_dir() { [ $DRY = 1 ] && echo /tmp/cbatch-dry-model || echo "$MODEL"; }
model_preset() { [ $DRY = 1 ] && echo tiny || echo qwen3-0.6b; }

# ---- what the first step switched off: its engine settings, passed to every later cbatch run of this call
OFF_SETTINGS=""  # KEY=VALUE ...
load_switched_off() {  # load_switched_off FILE   (first_step.py --switched-off)
  OFF_SETTINGS=$(tr '\n' ' ' < "$1" 2>/dev/null)
  [ -n "${OFF_SETTINGS// /}" ] && echo "switched off for the rest of this call (first step): $OFF_SETTINGS" | tee -a "$SUMMARY"
  return 0
}
off_args() {  # off_args [ENGINE_PREFIX]: --engine-arg PREFIXKEY=VALUE for each setting the first step switched off
  local kv
  for kv in $OFF_SETTINGS; do printf -- ' --engine-arg %s%s' "${1:-}" "$kv"; done
}

e2e_args() {  # e2e_args [REQUESTS]: the nano-vllm workload (dry: a handful of short requests on the tiny model, CPU)
  if [ $DRY = 1 ]; then
    echo "--device cpu --dtype float32 --model $(model_dir) --num-requests 4 --prompt-len 8,24 --output-len 4,8 --repeats 1 --threads 2 --engine-arg cbatch:attention_backend=triton$(off_args cbatch:)"
  else
    echo "--device cuda --dtype bfloat16 --model $MODEL --num-requests ${1:-256} --prompt-len 100,1024 --output-len 100,1024 --repeats 1 --engine-arg cbatch:max_model_len=2048$(off_args cbatch:)"
  fi
}

profile_args() {  # gpu_profile.py on the nano-vllm workload (dry: the tiny model, a few requests, CPU)
  if [ $DRY = 1 ]; then
    echo "--device cpu --dtype float32 --model $(model_dir) --num-requests 6 --prompt-len 8,24 --output-len 4,12 --profile-steps 3 --profile-batch 6 --engine-arg attention_backend=triton$(off_args)"
  else
    echo "--device cuda --dtype bfloat16 --model $MODEL --num-requests 256 --prompt-len 100,1024 --output-len 100,1024 --engine-arg max_model_len=2048$(off_args)"
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

# peer_args BUDGET REQUESTS: transformers' continuous batching against cbatch on REQUESTS of the workload, cbatch
# first, hf-cb guarded and with its fallback (the constants above), --json in $OUT (rewritten after every run)
peer_args() {
  local deadline=$(($(scaled "$1") - KILL_AFTER_S))  # compare_peers ends its own runs before the step's timeout
  if [ $DRY = 1 ]; then
    echo "$(e2e_args) --deadline $deadline --fallback-requests 2 --fallback-reserve $FALLBACK_RESERVE_S --min-peer-guard 100000 --json $OUT/hf_vs_cbatch.json"
  else
    echo "$(e2e_args "$2") --deadline $deadline --fallback-requests $FALLBACK_REQUESTS --fallback-reserve $FALLBACK_RESERVE_S --min-peer-guard $MIN_PEER_GUARD_S --json $OUT/hf_vs_cbatch.json"
  fi
}

part_peer() {  # the peer with time for its 256-request attempt (~320 s of guard)
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step hf_vs_cbatch $py benchmarks/compare_peers.py $(peer_args "$(budget_of hf_vs_cbatch)" 256) --engines cbatch,hf-cb
}

# gpu-tests: the kernel tests (no engines: each test's GPU memory is small, so 4 xdist workers share the card)
# and the GPU-only engine tests, counted (passed / failed / skipped) in the summary
GPU_TESTS="tests/test_kernels_fused.py tests/test_kernels_attention.py tests/test_kernels_sampler.py tests/test_kernels_gemm.py tests/test_fp32_logits.py tests/test_async_scheduling.py::test_a_steps_tokens_wait_for_that_step_alone"
part_gpu_tests() {
  if [ $DRY = 1 ]; then
    step gpu_tests $py -m pytest -p no:cacheprovider -rfE tests/test_kernels_fused.py -k "rotary and dtype0" tests/test_async_scheduling.py::test_a_steps_tokens_wait_for_that_step_alone
  else
    step gpu_tests $py -m pytest -p no:cacheprovider -rfE -n 4 $GPU_TESTS
  fi
}

# host_args: the host step (schedule + build + update) on this machine's CPU, no GPU (dry: fewer sequences and steps)
host_args() {
  if [ $DRY = 1 ]; then echo "--cpu-time --running 16 64 --steps 5"; else echo "--cpu-time --running 256 1024 --steps 30"; fi
}

# first_step: the probe (benchmarks/first_step.py); what it switched off goes to every later step
first_step() {
  local dev=cuda
  [ $DRY = 1 ] && dev=cpu
  step first_step $py benchmarks/first_step.py --model "$(model_dir)-first-step" --device $dev \
    --deadline $(($(scaled "$(budget_of first_step)") - KILL_AFTER_S)) --json "$OUT/first_step.json" \
    --switched-off "$LOGS/switched_off.txt" ${KIT_INJECT_FAILURE:+--fail "$KIT_INJECT_FAILURE"}
  load_switched_off "$LOGS/switched_off.txt"
}

# all: the first step, speed, the host step and the peer, in one call (the plan: --list)
part_all() {
  first_step
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step profile_bf16 $py benchmarks/gpu_profile.py $(profile_args) --temperatures 0,0.6 --json "$OUT/profile_bf16.json" --trace "$LOGS/trace_bf16.json.gz"
  step profile_fp8 $py benchmarks/gpu_profile.py $(profile_args) --engine-arg kv_cache_dtype=fp8 --profile-steps 0 --json "$OUT/profile_fp8.json"
  step decode_kernels $py benchmarks/bench_kernels.py $( [ $DRY = 1 ] && echo --cpu-smoke ) --quick --no-fused --out "$LOGS/decode_kernels.txt"
  step host_step $py benchmarks/host_overhead.py $(host_args) --json "$LOGS/host_step.json"
  local budget
  budget=$(elastic_budget hf_vs_cbatch)
  STEP_BUDGET=$budget step hf_vs_cbatch $py benchmarks/compare_peers.py $(peer_args "$budget" "$ALL_PEER_REQUESTS") --engines cbatch,hf-cb
}

# families: the kernels of the families landed without a device (DeepSeek's MLA decode, gpt-oss's MXFP4 grouped GEMM,
# expert parallelism's per-slot MoE): their tests on the GPU, then each kernel's time and bandwidth
FAMILY_KERNEL_TESTS="tests/test_kernels_mla.py tests/test_kernels_models.py"
part_families() {
  if [ $DRY = 1 ]; then
    step family_kernel_tests $py -m pytest -p no:cacheprovider -rfE tests/test_kernels_models.py -k "mxfp4 or expert_parallel"
  else
    step family_kernel_tests $py -m pytest -p no:cacheprovider -rfE $FAMILY_KERNEL_TESTS -k "mla or mxfp4 or expert_parallel or fused_moe"
  fi
  step mla_decode $py benchmarks/mla_decode.py $( [ $DRY = 1 ] && echo --cpu-smoke )
  step moe_mxfp4 $py benchmarks/bench_moe_fp8.py --quick $( [ $DRY = 1 ] && echo --cpu-smoke ) --out "$LOGS/moe_mxfp4.txt"
}

# vision: an OCR-shaped workload (issue 48) on a random-weight Qwen2.5-VL-7B shape built on the device, cbatch then
# transformers (each its own process: each takes the GPU's memory), and the tower's GPU attention checked first
part_vision() {
  step vision_check $py -m pytest -p no:cacheprovider -rfE tests/test_vision.py -k "flash or tower"
  local dry=""
  [ $DRY = 1 ] && dry=--cpu-dry-run
  step vision_cbatch $py benchmarks/vision_gpu.py $dry --engine cbatch --json "$OUT/vision_cbatch.json"
  step vision_hf $py benchmarks/vision_gpu.py $dry --engine hf --deadline $(($(scaled "$(budget_of vision_hf)") - KILL_AFTER_S)) \
    --json "$OUT/vision_hf.json" --against "$OUT/vision_cbatch.json"
}

part_kernels() {
  if [ $DRY = 1 ]; then
    step compile_check $py -c "print('offline sm_90 compile: tests/test_kernels_compile.py runs it in the suite')"
    step kernel_tests $py -m pytest -p no:cacheprovider -rfE tests/test_kernels_fused.py -k "norm_rope_store and dtype0 or fused_sample" tests/test_compile_count.py
  else
    step compile_check $py benchmarks/compile_check.py 90
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

part_e2e_split() {  # the e2e workload with split-KV off (--no-split-kv): the split policy's gain is e2e's tok/s over this one's
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step cbatch_no_split $py benchmarks/compare_peers.py $(e2e_args) --engines cbatch --engine-arg cbatch:split_kv=false --run-timeout 200 --json "$LOGS/e2e_no_split.json"
}

part_e2e_gemm() {  # the e2e workload with cuBLAS for every GEMM (--no-decode-gemm): the tuned decode GEMMs' gain is e2e's tok/s over this one's
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  step cbatch_no_gemm $py benchmarks/compare_peers.py $(e2e_args) --engines cbatch --engine-arg cbatch:decode_gemm=false --run-timeout 200 --json "$LOGS/e2e_no_gemm.json"
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

# spec: speculative decoding (issue 51) on the random Qwen3-0.6B: speculative_bench.py's copy-heavy workload (SmolLM2's
# token ids of its prompts: the carried tokenizer) and the random one, off against auto and ngram on one engine,
# tokens compared; first the copy-heavy workload on a variant of the model that loops over its prompts' tokens
# (where drafts hold). Figures in $OUT/spec.json, rewritten after each workload (dry: the tiny model, a few rows)
spec_args() {
  if [ $DRY = 1 ]; then
    echo "--device cpu --dtype float32 --model $(model_dir) --copying-model $(model_dir)-copying --rows 3 --max-tokens 16 --random-rows 2 --random-prompt 8:16 --random-output 6:10 --ignore-eos --mode auto,ngram --engine-arg attention_backend=triton$(off_args)"
  else
    echo "--device cuda --dtype bfloat16 --model $MODEL --copying-model $MODEL-copying --rows 256 --max-tokens 160 --random-rows 256 --random-prompt 100:1024 --random-output 100:1024 --ignore-eos --mode auto,ngram --engine-arg max_model_len=2048 --engine-arg cuda_graph_max_batch=256$(off_args)"
  fi
}

part_spec() {
  step make_model $py benchmarks/make_random_model.py "$(model_preset)" "$(model_dir)"
  TAIL_LINES=16 step spec_bench $py benchmarks/speculative_bench.py $(spec_args) --json "$OUT/spec.json"
}

run_part() {
  PART=$1
  [ -n "${PLAN[$PART]:-}" ] || { echo "unknown part '$PART'; parts: $PARTS" >&2; return 2; }
  [ "$(reserve_of "$PART")" -ge "$RESERVE_S" ] || { echo "BUG: part $PART plans $(worst_case "$PART") s: under ${RESERVE_S} s of reserve before the device's ${DEVICE_LIMIT_S} s" >&2; return 2; }
  PART_T0=$SECONDS
  LOGS=$(mktemp -d "${TMPDIR:-/tmp}/cbatch-$PART-XXXX")
  FAILED=0
  OFF_SETTINGS=""
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
      local p total=0 before files most=0 most_part="" marker
      before=$(cat "$SUMMARY" 2>/dev/null | wc -l)  # the pass check reads this run's lines only (a stale $OUT may hold a failed one)
      marker=$(mktemp)
      shift
      for p in ${*:-$PARTS}; do
        touch "$marker"
        run_part "$p" || total=$((total + 1))
        # what a device call of this part alone brings back: the files it wrote, and summary.txt
        files=$(( $(find "$OUT" -type f -newer "$marker" ! -name summary.txt | wc -l) + 1 ))
        if [ "$files" -gt "$most" ]; then most=$files; most_part=$p; fi
      done
      rm -f "$marker"
      # one archive for every part's logs (the parts' figures stay beside it)
      (cd "$OUT" && tar cf dry-run-logs.tar ./*-logs.tgz && rm -f ./*-logs.tgz)
      echo "dry run: $total part(s) failed to run; a part alone leaves at most $most file(s) in \$OUT (part $most_part; limit 8)" \
        | tee -a "$SUMMARY"
      [ "$total" -eq 0 ] && [ "$most" -le 8 ] && ! tail -n +$((before + 1)) "$SUMMARY" | grep -q -E "FAILED|TIMED OUT" ;;
    "") echo "usage: $0 PART | --list | --cpu-dry-run   (parts: $PARTS)" >&2; return 2 ;;
    *) run_part "$1" || return $?; echo; cat "$SUMMARY" ;;
  esac
}

[ "${BASH_SOURCE[0]}" = "$0" ] && main "$@"  # sourced (tests): the functions alone
