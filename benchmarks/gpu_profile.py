"""Where a cbatch run's GPU time goes: per-step times against each step's bandwidth floor, and a kernel profile.

    python benchmarks/gpu_profile.py --model /tmp/qwen3-0.6b-random --json OUT.json [--trace OUT.trace.json.gz]
        [--num-requests 256 --prompt-len 100,1024 --output-len 100,1024] [--temperatures 0,0.6]
        [--engine-arg kv_cache_dtype=fp8 ...] [--profile-steps 20 --profile-batch 192]

One process, one engine (built and warmed up once), the nano-vllm workload of compare_peers.py (same prompts
for the same seed). For each temperature in --temperatures: one timed run of the whole workload, with the
wall time of every engine.step() call and what the step held (decode rows, prefill tokens, KV context read).
Each step's floor is (weight bytes + KV bytes it reads) / the device-to-device copy bandwidth measured here:
the table shows, per step class (decode-only steps by batch size, mixed prefill steps), the median step time,
the median floor and their ratio, and how much of the run's wall time each class took.
Then (unless --profile-steps 0) the workload again, greedy, with torch.profiler over --profile-steps
decode-only steps taken once the batch has shrunk to --profile-batch rows or fewer (the steady decode of the
run's second half): GPU time per kernel class (attention, GEMM, norm/rotary, activation, sampler, copies,
other), the share of the window the GPU was busy, kernel launches per step, and the heaviest kernels by name.
Figures are printed as they come and written to --json (the start-up and tuning at once, then after each run); --trace keeps the profiler's Chrome trace (gzip).
--device cpu runs the same plumbing on a CPU (profiler CPU ops instead of kernels): a dry run for the kit.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare_peers import make_workload  # noqa: E402  (the same seeded workload as the e2e line)
from peer_engines import job_settings, parse_setting  # noqa: E402


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi

# kernel name (lower case) -> class; the first class with a matching fragment wins
KERNEL_CLASSES = (
    ("attention", ("paged_attention", "merge_splits", "flash", "fmha")),
    ("norm+rotary+kv store", ("norm_rope_store", "rotary", "store_kv", "rms_norm", "rmsnorm", "add_rms")),
    ("activation", ("silu", "gelu", "and_mul")),
    ("sampler", ("sample", "argmax", "gumbel", "exponential", "softmax", "topk", "top_k", "sort")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "cublas", "splitk", "mma", "_linear")),
    ("copy/fill", ("memcpy", "memset", "copy", "fill", "cat", "index", "gather", "scatter", "embedding")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, fragments in KERNEL_CLASSES:
        if any(f in low for f in fragments):
            return cls
    return "other"


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 10)."""
    if device.type != "cuda":
        return 50e9  # a nominal figure for the CPU dry run
    n = int(gib * 2**30) // 2
    a = torch.randn(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times[3:])


def weight_bytes(model_dir: Path) -> int:
    """Bytes a decode step reads of the weights: the checkpoint's tensors (tied embeddings counted once: the
    lm_head reads the whole matrix; the embedding lookup reads a few rows)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def kv_bytes_per_token(model_dir: Path, kv_elem: int) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * kv_elem


def step_class(decode_rows: int, prefill_tokens: int) -> str:
    if prefill_tokens:
        return "mixed (prefill chunks)"
    for top in (8, 32, 64, 128, 192, 256, 512, 1024):
        if decode_rows <= top:
            return f"decode <= {top} rows"
    return "decode > 1024 rows"


def timed_run(engine, workload, temperature: float, floor_of) -> dict:
    """The whole workload once; every engine.step() call timed and classed by the step it launched. Also the
    Triton kernel variants compiled inside the timed window (`jit_stats.compiled_variants`, the count
    compare_peers' lines give: 0 after a GPU engine's warm-up) and the process's peak GPU memory so far."""
    from cbatch.config import SamplingParams
    from cbatch.kernels.jit_stats import compiled_variants

    engine.reset()
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature,
                             seed=i if temperature else None) for i, n in enumerate(workload.output_lens)]
    for ids, p in zip(workload.prompts, params):
        engine.add_request(ids, p)
    steps = []
    cuda = engine.device is not None and engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    compiles = compiled_variants()
    t_start = last = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter()
        info = engine.last_step
        steps.append((now - last, info.scheduled_tokens, info.prefill_tokens, info.context_tokens))
        last = now
    sync()
    wall = time.perf_counter() - t_start
    compiles = compiled_variants() - compiles
    stats = engine.scheduler.stats
    by_class: dict[str, list] = defaultdict(list)
    for dt, tokens, prefill, context in steps:
        decode_rows = tokens - prefill if prefill else tokens
        by_class[step_class(decode_rows, prefill)].append((dt, floor_of(context), tokens))
    classes = {}
    for cls, rows in sorted(by_class.items()):
        dts = [r[0] for r in rows]
        floors = [r[1] for r in rows]
        classes[cls] = {
            "steps": len(rows), "share_of_wall": sum(dts) / wall,
            "median_ms": statistics.median(dts) * 1e3, "median_floor_ms": statistics.median(floors) * 1e3,
            "floor_over_time": sum(floors) / max(sum(dts), 1e-12),
            "median_tokens": statistics.median(r[2] for r in rows),
        }
    output_tokens = sum(workload.output_lens)
    floor_total = sum(floor_of(s[3]) for s in steps)
    return {
        "temperature": temperature, "wall_s": wall, "output_tok_s": output_tokens / wall,
        "total_tok_s": (output_tokens + sum(map(len, workload.prompts))) / wall,
        "steps": len(steps), "steps_scheduled_ahead": engine.steps_ahead,
        "mean_occupancy": stats.occupancy_sum / max(1, stats.steps),
        "bandwidth_floor_s": floor_total, "fraction_of_floor": floor_total / wall, "classes": classes,
        "kernel_compiles_in_window": compiles,
        "peak_gpu_mb": torch.cuda.max_memory_allocated(engine.device) / 2**20 if cuda else None,
    }


def profiled_run(engine, workload, num_steps: int, below_batch: int, trace_path: Path | None, floor_of,
                 prefill_steps: int = 3) -> dict:
    """Greedy workload again; torch.profiler over its first `prefill_steps` steps (prompt chunks), then over
    `num_steps` decode-only steps once <= below_batch rows run."""
    from torch.profiler import ProfilerActivity

    from cbatch.config import SamplingParams

    engine.reset()
    for ids, n in zip(workload.prompts, workload.output_lens):
        engine.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
    cuda = engine.device is not None and engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof, first, host_s = profile_steps(engine, prefill_steps, activities, cuda)  # prompt chunks (8192-token steps)
    prefill = summarize_trace(chrome_trace(prof), first, host_s, cuda)
    while engine.has_unfinished():  # run up to the window: decode-only steps at <= below_batch rows
        engine.step()
        info = engine.last_step
        if not info.prefill_tokens and 0 < info.scheduled_tokens <= below_batch:
            break
    if not engine.has_unfinished():
        return {"error": f"no decode-only step at <= {below_batch} rows"}
    prof, window, host_s = profile_steps(engine, num_steps, activities, cuda)
    while engine.has_unfinished():
        engine.step()
    trace = chrome_trace(prof)
    if trace_path is not None:
        with gzip.open(trace_path, "wt") as f:
            json.dump(trace, f)
    summary = summarize_trace(trace, window, host_s, cuda)
    summary["first_steps"] = prefill
    if window:
        summary["floor_ms_per_step"] = statistics.mean(floor_of(c) for _, _, c in window) * 1e3
        summary["floor_kv_only_ms_per_step"] = summary["floor_ms_per_step"] - floor_of(0) * 1e3
    return summary


def profile_steps(engine, count: int, activities, cuda: bool):
    """(profiler, [(tokens, prefill tokens, context tokens)] per step, host seconds) over the next `count` steps."""
    from torch.profiler import profile

    steps: list[tuple[int, int, int]] = []
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        while engine.has_unfinished() and len(steps) < count:
            engine.step()
            info = engine.last_step
            steps.append((info.scheduled_tokens, info.prefill_tokens, info.context_tokens))
        if cuda:
            torch.cuda.synchronize()
        host_s = time.perf_counter() - t0
    return prof, steps, host_s


def chrome_trace(prof) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def summarize_trace(trace: dict, window: list[tuple[int, int, int]], host_s: float, cuda: bool) -> dict:
    """GPU kernel time by class, busy share of the window, launches per step, the heaviest kernels."""
    cats = ("kernel", "gpu_memcpy", "gpu_memset") if cuda else ("cpu_op",)
    events = [e for e in trace.get("traceEvents", []) if e.get("cat") in cats and e.get("ph") == "X"]
    if not cuda:  # dry run: top-level CPU ops only would need nesting; keep every op, figures are plumbing only
        events = events[:20000]
    n = max(1, len(window))
    if not events:
        return {"error": "the profiler recorded no kernels", "steps": len(window)}
    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events)
    span = intervals[-1][1] - intervals[0][0]
    busy, cur_s, cur_e = 0.0, *intervals[0]
    for s, e in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    by_class: dict[str, float] = defaultdict(float)
    count_class: dict[str, int] = defaultdict(int)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in events:
        cls = kernel_class(e["name"])
        by_class[cls] += float(e.get("dur", 0))
        count_class[cls] += 1
        by_name[e["name"][:90]][0] += float(e.get("dur", 0))
        by_name[e["name"][:90]][1] += 1
    total = sum(by_class.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "steps": len(window), "mean_rows": statistics.mean(r for r, _, _ in window) if window else 0,
        "window_ms": span / 1e3, "host_ms": host_s * 1e3, "busy_share": busy / max(span, 1e-9),
        "gpu_ms_per_step": total / n / 1e3, "span_ms_per_step": span / n / 1e3,
        "launches_per_step": len(events) / n,
        "classes": {c: {"ms_per_step": t / n / 1e3, "share": t / max(total, 1e-9), "per_step": count_class[c] / n}
                    for c, t in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": k, "ms_per_step": v[0] / n / 1e3, "calls_per_step": v[1] / n} for k, v in top],
    }


def print_timed(run: dict) -> None:
    print(f"\ntemperature {run['temperature']}: {run['output_tok_s']:,.0f} output tok/s ({run['total_tok_s']:,.0f} total), "
          f"{run['wall_s']:.2f} s, {run['steps']} steps ({run['steps_scheduled_ahead']} scheduled ahead), "
          f"occupancy {run['mean_occupancy']:.1f}; bandwidth floor {run['bandwidth_floor_s']:.2f} s = "
          f"{run['fraction_of_floor']:.0%} of it reached; kernel compiles in the timed window: "
          f"{run['kernel_compiles_in_window']}; peak GPU "
          + (f"{run['peak_gpu_mb']:,.0f} MB" if run["peak_gpu_mb"] is not None else "n/a (CPU)"))
    print(f"  {'step class':<24} {'steps':>6} {'wall share':>10} {'median ms':>10} {'floor ms':>9} {'floor/time':>10} {'tokens':>7}")
    for cls, c in run["classes"].items():
        print(f"  {cls:<24} {c['steps']:>6} {c['share_of_wall']:>10.1%} {c['median_ms']:>10.3f} "
              f"{c['median_floor_ms']:>9.3f} {c['floor_over_time']:>10.0%} {c['median_tokens']:>7.0f}")


def print_profile(p: dict, what: str = "decode steps") -> None:
    if "error" in p:
        print(f"\nprofile: {p['error']}")
        return
    if "first_steps" in p:
        print_profile(p["first_steps"], "first steps (prompt chunks)")
    print(f"\nprofile of {p['steps']} {what} at {p['mean_rows']:.0f} tokens: GPU {p['gpu_ms_per_step']:.3f} ms/step "
          f"of a {p['span_ms_per_step']:.3f} ms span (busy {p['busy_share']:.0%}), {p['launches_per_step']:.0f} "
          f"kernels/step; host {p['host_ms'] / max(1, p['steps']):.3f} ms/step under the profiler")
    if "floor_ms_per_step" in p:
        print(f"  bandwidth floor of these steps {p['floor_ms_per_step']:.3f} ms/step, of which the KV reads "
              f"{p['floor_kv_only_ms_per_step']:.3f} (attention's floor)")
    for cls, c in p["classes"].items():
        print(f"  {cls:<22} {c['ms_per_step']:>8.3f} ms/step {c['share']:>6.1%} {c['per_step']:>6.0f} kernels/step")
    print("  heaviest kernels:")
    for k in p["top_kernels"]:
        print(f"    {k['ms_per_step']:>8.3f} ms/step x{k['calls_per_step']:>5.0f}  {k['name']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder (make_random_model.py qwen3-0.6b DIR)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", default="100,1024")
    p.add_argument("--output-len", default="100,1024")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperatures", default="0", help="comma-separated: one timed run each")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="an EngineConfig field")
    p.add_argument("--profile-steps", type=int, default=20, help="0: no profiled run")
    p.add_argument("--profile-batch", type=int, default=192, help="profile once decode steps have <= this many rows")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--trace", type=Path, default=None, help="write the profiler's Chrome trace here (gzip)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import build_engine
    from cbatch.engine.engine import run_to_completion

    device = torch.device(args.device)
    settings = job_settings(dict(map(parse_setting, args.engine_arg)), args.num_requests)
    t_process = time.perf_counter()
    bw = copy_bandwidth(device)
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, **settings)
    engine = build_engine(config)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    lo, hi = parse_range(args.output_len)
    workload = make_workload(args.num_requests, args.seed, parse_range(args.prompt_len), vocab,
                             output_mix=((1.0, lo, hi),))
    run_to_completion(engine, [workload.prompts[0][:16]], [SamplingParams(max_tokens=4, ignore_eos=True)])
    startup_s = time.perf_counter() - t_process
    kv_elem = 1 if engine.config.kv_cache_dtype == "fp8" else engine.dtype.itemsize
    w_bytes, kv_token = weight_bytes(Path(args.model)), kv_bytes_per_token(Path(args.model), kv_elem)

    def floor_of(context_tokens: int) -> float:
        return (w_bytes + context_tokens * kv_token) / bw

    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "copy_bw_tb_s": bw / 1e12, "settings": settings,
              "max_num_seqs": engine.config.max_num_seqs, "num_kv_blocks": engine.pool.num_blocks,
              "kv_cache_dtype": engine.config.kv_cache_dtype, "weight_bytes": w_bytes, "kv_bytes_per_token": kv_token,
              "startup_s": startup_s, "kernel_tuning": engine.kernel_tuning, "runs": []}

    def save() -> None:  # after every figure: a step killed at its budget keeps what came before
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))

    save()  # the start-up and the tuned choices, before any timed run
    print(f"{result['device']}: copy {bw / 1e12:.2f} TB/s; engine built and warmed up in {startup_s:.1f} s "
          f"(max_num_seqs {engine.config.max_num_seqs}, {engine.pool.num_blocks} KV blocks, KV {result['kv_cache_dtype']}); "
          f"weights {w_bytes / 1e9:.2f} GB, KV {kv_token / 1024:.0f} KiB/token", flush=True)
    if engine.kernel_tuning:
        from cbatch.observe.report import describe_attention_tuning, describe_gemm_tuning, describe_split_tuning

        t = engine.kernel_tuning
        print(f"start-up tuning: {describe_attention_tuning(t)}; us per candidate: {t['times_us']}", flush=True)
        if t.get("kv_splits"):
            print(f"start-up tuning: split-KV {describe_split_tuning(t['kv_splits'])}; score per rule (1.0 per probe "
                  f"is the fastest): {t['kv_splits']['scores']}; us per launch: {t['kv_splits']['times_us']}",
                  flush=True)
        if t.get("decode_gemm"):
            print(f"start-up tuning: decode GEMMs: {describe_gemm_tuning(t['decode_gemm'])}; us per candidate: "
                  f"{t['decode_gemm']['times_us']}", flush=True)

    for temperature in (float(t) for t in args.temperatures.split(",")):
        run = timed_run(engine, workload, temperature, floor_of)
        result["runs"].append(run)
        print_timed(run)
        save()
    if args.profile_steps:
        result["profile"] = profiled_run(engine, workload, args.profile_steps, args.profile_batch, args.trace, floor_of)
        print_profile(result["profile"])
        save()
    result["process_s"] = time.perf_counter() - t_process
    save()
    engine.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
