"""cbatch against its peers on one seeded workload: HF transformers continuous batching and static `generate`.

    python benchmarks/compare_peers.py                      # 64 requests, float32, 3 interleaved repeats
    python benchmarks/compare_peers.py --dtype bfloat16 --engines cbatch,hf-cb
    python benchmarks/compare_peers.py --engines cbatch@bfloat16,hf-cb@float32,hf-cb@bfloat16   # each at its best
    python benchmarks/compare_peers.py --quick              # 16 short requests, 1 repeat: a smoke test
    # GPU, the nano-vllm workload on a random-weight Qwen3-0.6B checkpoint (benchmarks/gpu_session.sh makes it):
    python benchmarks/compare_peers.py --device cuda --dtype bfloat16 --model /tmp/qwen3-0.6b-random \
        --num-requests 256 --prompt-len 100,1024 --output-len 100,1024 --engines cbatch,hf-cb --repeats 1

Every run of every engine happens in a fresh subprocess (so peak RSS is that engine's alone), with the
same model files, dtype and thread count. A run that fails or outlasts --run-timeout is reported as
failed and the others go on; each run's figures are printed (and written to --json) as soon as it ends,
so a failing peer never costs cbatch's figures. cbatch runs also report its steps, mean batch occupancy
and the Triton kernels compiled inside the timed window (0 after the engine's warm-up). Runs are interleaved (cbatch, hf-cb, hf-static, cbatch, ...)
so that load from other processes hits every engine alike; the table shows medians over repeats.
Timing covers generation only: model load and one short warm-up request are excluded for every engine.
EOS is ignored everywhere: each request produces exactly its own number of output tokens.

The compute floor is the workload's FLOPs (2 x linear-layer parameters x tokens, plus causal attention,
plus logits only for sampled tokens) over the best GEMM rate measured here at the model's shapes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ENGINES = ("cbatch", "hf-cb", "hf-static")
DTYPES = ("float32", "bfloat16", "float16")


# ---- the workload ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def total_tokens(self) -> int:
        return self.output_tokens + sum(len(p) for p in self.prompts)


# (share of requests, shortest, longest output)
OUTPUT_MIX = ((0.7, 8, 32), (0.2, 32, 128), (0.1, 128, 256))


def make_workload(num_requests: int, seed: int, prompt_range: tuple[int, int], vocab_size: int,
                  output_mix=OUTPUT_MIX) -> Workload:
    """Random token-id prompts (uniform length) and outputs drawn from `output_mix` in exact shares
    (a mix of one band, e.g. ((1.0, 100, 1024),), is a uniform length)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)]
    counts = [round(share * num_requests) for share, _, _ in output_mix]
    counts[0] += num_requests - sum(counts)
    lens = [rng.randint(lo, hi) for (_, lo, hi), n in zip(output_mix, counts) for _ in range(n)]
    rng.shuffle(lens)
    return Workload(prompts, lens)


def workload_flops(spec: dict, wl: Workload) -> float:
    """2 x linear params per token + causal attention (QK and PV) + logits for sampled tokens only."""
    h, layers, inter = spec["hidden_size"], spec["num_hidden_layers"], spec["intermediate_size"]
    hq = spec["num_attention_heads"]
    hkv = spec.get("num_key_value_heads", hq)
    d = spec.get("head_dim") or h // hq
    linear = layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter)
    flops = 0.0
    for prompt, out in zip(wl.prompts, wl.output_lens):
        # tokens the model computes: the prompt and every output but the last (which is sampled, never fed back)
        n = len(prompt) + out - 1
        flops += 2 * linear * n
        flops += 4 * layers * hq * d * (n * (n + 1) / 2)  # token at position p attends p+1 keys
        flops += 2 * h * spec["vocab_size"] * out
    return flops


# ---- one engine run, inside a fresh subprocess -------------------------------------------------------------
def _device() -> str:
    return os.environ.get("CBATCH_PEERS_DEVICE", "cpu")


def _sync() -> None:
    if _device() == "cuda":
        import torch

        torch.cuda.synchronize()


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def run_cbatch(model_dir: str, wl: Workload, dtype: str, threads: int, extra: dict) -> list[list[int]]:
    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import build_engine
    from cbatch.engine.engine import run_to_completion

    engine = build_engine(EngineConfig(model=model_dir, dtype=dtype, num_threads=threads, device=_device(), **extra))
    run_to_completion(engine, [wl.prompts[0][:16]], [SamplingParams(max_tokens=4, ignore_eos=True)])  # warm-up
    engine.reset()  # fresh step counters for the timed run
    temperature = _temperature()
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature, seed=i if temperature else None)
              for i, n in enumerate(wl.output_lens)]
    compiles = _compiled_variants()
    _mark_start()
    outs = run_to_completion(engine, wl.prompts, params)
    _mark_end()
    stats = engine.scheduler.stats
    _CLOCK["details"] = {
        "kernel_compiles_in_window": None if compiles is None else _compiled_variants() - compiles,
        "steps": stats.steps, "mean_occupancy": stats.occupancy_sum / max(1, stats.steps),
        "max_num_seqs": engine.config.max_num_seqs, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "num_kv_blocks": engine.pool.num_blocks, "kv_cache_dtype": engine.config.kv_cache_dtype,
    }
    return [o.token_ids for o in outs]


def _compiled_variants() -> int | None:
    """Triton kernel variants compiled so far (None without triton)."""
    try:
        from cbatch.kernels.jit_stats import compiled_variants
    except ImportError:
        return None
    return compiled_variants()


def _temperature() -> float:
    return float(os.environ.get("CBATCH_PEERS_TEMPERATURE", "0"))


def _load_hf(model_dir: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    return model.to(_device())


def run_hf_static(model_dir: str, wl: Workload, dtype: str, threads: int, extra: dict) -> list[list[int]]:
    """`generate` over fixed batches in input order: left padding, each batch runs to its longest member."""
    import torch

    model = _load_hf(model_dir, dtype)
    batch_size = int(extra.get("batch_size", 16))
    pad = 0  # attention_mask hides padding; the id itself is never attended to

    def generate(prompts: list[list[int]], max_new: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=_device())
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=_device())
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=0,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad)
        return out[:, width:]

    model.generation_config.eos_token_id = None  # EOS ignored: every row runs to max_new_tokens
    generate([wl.prompts[0][:16]], 4)  # warm-up
    results: list[list[int]] = []
    _mark_start()
    for i in range(0, len(wl.prompts), batch_size):
        prompts, lens = wl.prompts[i : i + batch_size], wl.output_lens[i : i + batch_size]
        new = generate(prompts, max(lens))
        results.extend(new[j, :n].tolist() for j, n in enumerate(lens))  # each row truncated to its own length
    _mark_end()
    return results


def run_hf_cb(model_dir: str, wl: Workload, dtype: str, threads: int, extra: dict) -> list[list[int]]:
    """transformers' continuous batching manager; per-request max_new_tokens, EOS disabled (-1)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = _load_hf(model_dir, dtype)
    temperature = _temperature()
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)
    gen = GenerationConfig(max_new_tokens=max(wl.output_lens), eos_token_id=-1, pad_token_id=0, **sampling)
    cb = ContinuousBatchingConfig(**{k: int(v) for k, v in extra.items()})
    hints = WorkloadHints(max_prompt_length=max(map(len, wl.prompts)), max_generated_length=max(wl.output_lens),
                          num_requests=len(wl.prompts))
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb, workload_hints=hints)
    manager.start()
    try:
        def run(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
            ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                   for i, (p, n) in enumerate(zip(prompts, lens))]
            done: dict[str, list[int]] = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=5)
                if result is None:  # nothing yet (a loaded machine can take minutes), or the loop died
                    if not manager.is_running():
                        raise RuntimeError("transformers continuous batching stopped without finishing every request")
                    continue
                if result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers continuous batching failed: {result.error}")
                    done[result.request_id] = list(result.generated_tokens)
            return [done[i] for i in ids]

        run([wl.prompts[0][:16]], [4])  # warm-up
        _mark_start()
        outs = run(wl.prompts, wl.output_lens)
        _mark_end()
    finally:
        manager.stop(block=True, timeout=10)
    return outs


RUNNERS = {"cbatch": run_cbatch, "hf-cb": run_hf_cb, "hf-static": run_hf_static}
_CLOCK: dict[str, float] = {}


def _mark_start() -> None:
    _sync()
    _CLOCK["start"] = time.perf_counter()


def _mark_end() -> None:
    _sync()
    _CLOCK["end"] = time.perf_counter()


def worker(args: argparse.Namespace) -> None:
    """Runs one engine on the workload in `args.workload` and writes its figures as JSON to `args.result`."""
    _set_threads(args.threads)
    data = json.loads(Path(args.workload).read_text())
    wl = Workload(data["prompts"], data["output_lens"])
    outs = RUNNERS[args.worker](data["model_dir"], wl, args.dtype, args.threads, data["extra"].get(args.worker, {}))
    wall = _CLOCK["end"] - _CLOCK["start"]
    got = [len(o) for o in outs]
    if got != wl.output_lens:
        bad = sum(g != w for g, w in zip(got, wl.output_lens))
        raise SystemExit(f"{args.worker}: {bad} requests came back with the wrong number of tokens (EOS not ignored?)")
    result = {
        "engine": args.worker,
        "wall_s": wall,
        "output_tok_s": wl.output_tokens / wall,
        "total_tok_s": wl.total_tokens / wall,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "peak_gpu_mb": _peak_gpu_mb(),
        **_CLOCK.get("details", {}),
        "outputs": outs,
    }
    Path(args.result).write_text(json.dumps(result))


def _peak_gpu_mb() -> float | None:
    if _device() != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**20


def gemm_probe(args: argparse.Namespace) -> None:
    """Best GEMM rate (GFLOP/s) at the model's layer shapes with many rows (prefill-sized): the floor's rate."""
    import torch

    _set_threads(args.threads)
    spec = json.loads(Path(args.workload).read_text())["spec"]
    h, inter = spec["hidden_size"], spec["intermediate_size"]
    hq, hkv = spec["num_attention_heads"], spec.get("num_key_value_heads", spec["num_attention_heads"])
    d = spec.get("head_dim") or h // hq
    shapes = [((hq + 2 * hkv) * d, h), (h, hq * d), (2 * inter, h), (h, inter)]
    from cbatch.model.layers import linear  # oneDNN for float32 on CPU (see there); torch's F.linear uses MKL

    dtype = getattr(torch, args.dtype)
    device = _device()
    weights = [torch.randn(n, k, dtype=dtype, device=device) * 0.02 for n, k in shapes]
    best = {"torch": 0.0, "cbatch": 0.0}
    for rows in (256, 512, 1024, 2048):
        xs = [torch.randn(rows, k, dtype=dtype, device=device) for _, k in shapes]
        flops = sum(2 * rows * n * k for n, k in shapes)
        for name, fn in (("torch", torch.nn.functional.linear), ("cbatch", linear)):
            for _ in range(7):
                _sync()
                t = time.perf_counter()
                for x, w in zip(xs, weights):
                    fn(x, w)
                _sync()
                best[name] = max(best[name], flops / (time.perf_counter() - t) / 1e9)
    Path(args.result).write_text(json.dumps({"gflops": max(best.values()), "by_path": best}))


# ---- the driver ------------------------------------------------------------------------------------------
def _spawn(mode: str, name: str, args: argparse.Namespace, workload_path: Path, tmp: Path, dtype: str) -> dict:
    result_path = tmp / f"{name}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, __file__, f"--{mode}", name, "--workload", str(workload_path), "--result", str(result_path),
           "--dtype", dtype, "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false",
               CBATCH_PEERS_DEVICE=args.device)
    if args.temperature:
        env["CBATCH_PEERS_TEMPERATURE"] = str(args.temperature)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired as exc:
        return {"engine": name, "error": f"timed out after {args.run_timeout:.0f} s", "log": str(exc.stderr or "")[-3000:]}
    if proc.returncode != 0:
        return {"engine": name, "error": f"exit {proc.returncode}", "log": proc.stderr[-3000:]}
    return json.loads(result_path.read_text())


def _parse_extra(items: list[str]) -> dict[str, dict]:
    """`--engine-arg cbatch:max_num_seqs=128` -> {"cbatch": {"max_num_seqs": 128}}"""
    extra: dict[str, dict] = {}
    for item in items:
        try:
            engine, rest = item.split(":", 1)
            key, value = rest.split("=", 1)
        except ValueError:
            raise SystemExit(f"--engine-arg {item!r}: expected ENGINE:KEY=VALUE, e.g. cbatch:max_num_seqs=128") from None
        if engine not in ENGINES:
            raise SystemExit(f"--engine-arg {item!r}: engine must be one of {', '.join(ENGINES)}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        extra.setdefault(engine, {})[key] = parsed
    return extra


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _machine() -> str:
    import torch

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated, from {','.join(ENGINES)}; ENGINE@DTYPE runs one in its own dtype "
                        "(cbatch@bfloat16,hf-cb@float32,hf-cb@bfloat16); the first cbatch entry is compared to each peer")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per engine (the table shows medians)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="for every engine not given its own with @")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for every engine")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", default="16,256", help="shortest,longest prompt (tokens)")
    p.add_argument("--output-len", default=None, help="shortest,longest output, uniform (default: the 70/20/10 mix)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every engine runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ENGINE:KEY=VALUE",
                   help="e.g. cbatch:max_num_seqs=128, hf-cb:max_batch_tokens=512, hf-static:batch_size=16")
    p.add_argument("--cooldown", type=float, default=None,
                   help="seconds of quiet before every run (default 20 on CPU, 0 with --quick or on CUDA). On this VM a run started just after a "
                        "large process exits is slowed while the freed memory goes back to the host: cbatch measured "
                        "11.6 s normally, 15.3 s right after a 13 GB process, 11.9 s 20 s later")
    p.add_argument("--quick", action="store_true", help="16 requests, prompts 16-64, outputs 8-32, one repeat")
    p.add_argument("--json", default=None, help="also write every run's figures to this file (after every run)")
    p.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (seeded rows; 0 = greedy)")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds before one run is killed and reported failed")
    # internal: one engine run inside a subprocess
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--probe", choices=("gemm",), help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.worker:
        return worker(args)
    if args.probe:
        return gemm_probe(args)

    # entries: "engine" runs in --dtype, "engine@dtype" in its own (e.g. cbatch@bfloat16,hf-cb@float32)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    dtype_of = {e: e.partition("@")[2] or args.dtype for e in engines}
    engine_of = {e: e.partition("@")[0] for e in engines}
    unknown = [e for e in engines if engine_of[e] not in ENGINES or dtype_of[e] not in DTYPES]
    if unknown or not engines:
        raise SystemExit(f"--engines: cannot read {unknown}; engines {', '.join(ENGINES)}, each optionally "
                         f"@{'|@'.join(DTYPES)}")
    extra = _parse_extra(args.engine_arg)
    if args.device == "cpu":  # its best setting on the 2-core CPU (see RESULTS.md); on a GPU, its own defaults
        extra.setdefault("hf-cb", {}).setdefault("max_batch_tokens", 512)
    extra.setdefault("hf-static", {}).setdefault("batch_size", 16)
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    mix = OUTPUT_MIX
    if args.output_len:
        out_lo, out_hi = (int(x) for x in args.output_len.split(","))
        mix = ((1.0, out_lo, out_hi),)
    if args.quick:
        args.num_requests, lo, hi, args.repeats, mix = 16, 16, 64, 1, ((1.0, 8, 32),)
    if args.cooldown is None:
        args.cooldown = 0.0 if args.quick or args.device == "cuda" else 20.0

    from cbatch.model.default_model import default_model_dir

    model_dir = str(Path(args.model).resolve()) if args.model else str(default_model_dir())
    spec = json.loads((Path(model_dir) / "config.json").read_text())
    wl = make_workload(args.num_requests, args.seed, (lo, hi), spec["vocab_size"], mix)
    flops = workload_flops(spec, wl)
    with tempfile.TemporaryDirectory(prefix="cbatch-peers-") as tmp_name:
        tmp = Path(tmp_name)
        workload_path = tmp / "workload.json"
        workload_path.write_text(json.dumps({"model_dir": model_dir, "spec": spec, "extra": extra,
                                             "prompts": wl.prompts, "output_lens": wl.output_lens}))
        load_before = os.getloadavg()
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        probes: dict[str, dict] = {}
        for r in range(args.repeats):  # engines first, the GEMM probe last: a probe that fails costs no figures
            for engine in engines:
                time.sleep(args.cooldown)
                res = _spawn("worker", engine_of[engine], args, workload_path, tmp, dtype_of[engine])
                res["load_1min"] = os.getloadavg()[0]
                runs[engine].append(res)
                print(f"run {r + 1}/{args.repeats} {engine}: {_run_line(res)}", flush=True)
                _write_json(args, runs, probes, flops)
        for dt in dict.fromkeys(dtype_of.values()):
            probes[dt] = _spawn("probe", "gemm", args, workload_path, tmp, dt)
        load_after = os.getloadavg()
    _write_json(args, runs, probes, flops)
    floor_s = {dt: flops / (probe["gflops"] * 1e9) for dt, probe in probes.items() if "gflops" in probe}
    print(f"\nmachine: {_machine()}")
    print(f"workload: {len(wl.prompts)} requests, prompts {lo}-{hi} tokens, {wl.output_tokens} output / "
          f"{wl.total_tokens} total tokens, seed {args.seed}; model {Path(model_dir).name}, "
          f"{'/'.join(dict.fromkeys(dtype_of.values()))}, {args.threads} threads, EOS ignored, "
          f"{f'temperature {args.temperature} (seeded)' if args.temperature else 'greedy'}")
    for dt, probe in probes.items():
        if dt not in floor_s:
            print(f"compute floor ({dt}): GEMM probe failed ({probe.get('error')})")
            continue
        paths = ", ".join(f"{k} {v:.0f}" for k, v in probe["by_path"].items())
        print(f"compute floor ({dt}): {flops / 1e12:.2f} TFLOP at {probe['gflops']:.0f} GFLOP/s (best GEMM at the "
              f"model's shapes, {args.threads} threads; by path: {paths}) = {floor_s[dt]:.1f} s")
    print(f"load average (1/5/15 min): before {'/'.join(f'{x:.2f}' for x in load_before)}, "
          f"after {'/'.join(f'{x:.2f}' for x in load_after)}; medians of {args.repeats} interleaved repeats\n")
    _print_table(engines, engine_of, dtype_of, runs, floor_s, greedy=not args.temperature)


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "error" not in r]


def _run_line(res: dict) -> str:
    """One run's figures, printed as soon as it ends."""
    if "error" in res:
        return f"FAILED ({res['error']}): {res.get('log', '')[-600:]}"
    line = (f"{res['wall_s']:.2f} s, {res['output_tok_s']:.1f} output tok/s, {res['total_tok_s']:.1f} total tok/s, "
            f"peak RSS {res['peak_rss_mb']:.0f} MB")
    if res.get("peak_gpu_mb"):
        line += f", peak GPU {res['peak_gpu_mb']:.0f} MB"
    if "steps" in res:
        line += (f", {res['steps']} steps, occupancy {res['mean_occupancy']:.0%} of {res['max_num_seqs']} seqs "
                 f"(budget {res['max_num_batched_tokens']} tokens, {res['num_kv_blocks']} KV blocks, "
                 f"KV {res['kv_cache_dtype']}), kernel compiles in the timed window: {res['kernel_compiles_in_window']}")
    return line


def _write_json(args: argparse.Namespace, runs: dict, probes: dict, flops: float) -> None:
    if not args.json:
        return
    slim = {e: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for e, rs in runs.items()}
    Path(args.json).write_text(json.dumps({"runs": slim, "gemm_gflops": {dt: p.get("by_path") for dt, p in probes.items()},
                                           "flops": flops, "args": vars(args), "machine": _machine()}, indent=2))


def _print_table(engines, engine_of, dtype_of, runs, floor_s, greedy: bool) -> None:
    first = engines[0]
    peers = [e for e in engines[1:] if engine_of[e] != "cbatch"] if engine_of[first] == "cbatch" else []
    header = "| engine | dtype | output tok/s | total tok/s | wall s | peak RSS MB | peak GPU MB | floor reached |"
    for peer in peers:
        header += f" {first} / {peer} |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for engine in engines:
        rows = _ok(runs[engine])
        if not rows:
            print(f"| {engine_of[engine]} | {dtype_of[engine]} | failed: {runs[engine][0]['error']} |")
            continue
        wall = _median(rows, "wall_s")
        floor = f"{floor_s[dtype_of[engine]] / wall:.0%}" if dtype_of[engine] in floor_s else "-"
        line = (f"| {engine_of[engine]} | {dtype_of[engine]} | {_median(rows, 'output_tok_s'):.1f} | "
                f"{_median(rows, 'total_tok_s'):.1f} | {wall:.2f} | {_median(rows, 'peak_rss_mb'):.0f} | "
                f"{rows[0].get('peak_gpu_mb') or 0:.0f} | {floor} |")
        for peer in peers:
            ok = _ok(runs[engine]) and _ok(runs[peer])
            ratio = f"{_median(_ok(runs[engine]), 'output_tok_s') / _median(_ok(runs[peer]), 'output_tok_s'):.2f}x" if ok else "-"
            line += f" {ratio} |" if engine == first else " |"
        print(line)
    if engine_of[first] == "cbatch" and greedy and _ok(runs[first]):
        ref = _ok(runs[first])[0]["outputs"]
        for engine in engines[1:]:
            if _ok(runs[engine]):
                same = sum(a == b for a, b in zip(ref, _ok(runs[engine])[0]["outputs"]))
                print(f"\n{engine}: {same}/{len(ref)} requests token-identical to {first} (greedy)", end="")
        print()


if __name__ == "__main__":
    main()
