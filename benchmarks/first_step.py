"""The GPU kit's first step: every piece the figures depend on, on a tiny engine, before any figure is at stake.

    python benchmarks/first_step.py --model DIR --json OUT.json --switched-off OFF.txt [--device cuda]
        [--deadline 40] [--fail PIECE ...]

A two-layer model with Qwen3-0.6B's layer shapes (made in DIR by the first try when missing) runs as the kit's engines will: start-up
tuning (tiles, split-KV, decode GEMMs, with the profile's max_model_len and graph cap, so its choices land in the
tuning cache the later steps read), CUDA graphs, float32 logits and the vocabulary-split sampler, decoding a few
greedy and sampled tokens. Each try is a fresh process (a device error can poison the CUDA context) that prints the
phase it enters; a try that fails names the phase, and the pieces that run from that phase on are switched off one
at a time (the pieces first run there first, then the earlier ones) until a try passes. A passing try whose tuning
fell back (`kernels/tuning._guarded`) names that tuner too. What is off, and why, goes to --json and, as the engine
settings that switch it off (KEY=VALUE lines), to --switched-off, which the kit passes to every later step; both are
rewritten after every try, so a step killed at its budget keeps what it had found.

--fail PIECE (a test and dry-run hook): that piece fails where it first runs, as a device error would.
Exit status 0 when a try passed (pieces switched off or not), 1 when none did before --deadline.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # cbatch from this checkout in the tries' processes too

PHASES = ("tuning", "sizing", "graphs", "warm-up", "decode")  # a GPU engine's start, in order, then its steps
PHASE_MARK = "first-step phase: "
RESULT_MARK = "first-step result: "


@dataclass(frozen=True)
class Piece:
    name: str
    phase: str  # where it first runs (it runs in every later phase too)
    off: dict  # the EngineConfig settings that switch it off


PIECES = (
    Piece("kernel_tuning", "tuning", {"tune_kernels": False}),
    Piece("split_kv", "sizing", {"split_kv": False}),
    Piece("fp32_logits", "sizing", {"fp32_logits": False}),
    Piece("split_sampler", "sizing", {"split_sampler": False}),
    Piece("decode_gemm", "graphs", {"decode_gemm": False}),  # the Triton GEMM runs inside the decode graphs only
    Piece("cuda_graphs", "graphs", {"enforce_eager": True}),
)
BY_NAME = {p.name: p for p in PIECES}
TUNERS = (((), "kernel_tuning"), (("kv_splits",), "kernel_tuning"), (("decode_gemm",), "decode_gemm"))


@dataclass
class Try:
    """One engine's try with some pieces off: passed, or the phase it failed in and the error's last line."""

    off: frozenset[str]
    ok: bool
    phase: str | None = None  # the last phase entered (None: failed before the first)
    error: str = ""
    tuning: dict | None = None  # a passing try's kernel_tuning report
    seconds: float = 0.0

    def reached(self) -> int:
        return PHASES.index(self.phase) if self.phase in PHASES else -1


@dataclass
class Outcome:
    off: dict[str, str] = field(default_factory=dict)  # piece -> why it was switched off
    tries: list[Try] = field(default_factory=list)
    ok: bool = False

    def settings(self) -> dict:
        """The engine settings that switch off every piece in `off`."""
        return {k: v for name in self.off for k, v in BY_NAME[name].off.items()}


def suspects(phase: str | None, off: set[str] | frozenset[str]) -> list[Piece]:
    """The pieces still on that run in `phase` (unknown: any): those first run there, then earlier ones, latest first."""
    at = PHASES.index(phase) if phase in PHASES else len(PHASES) - 1
    on = [p for p in PIECES if p.name not in off and PHASES.index(p.phase) <= at]
    return sorted(on, key=lambda p: -PHASES.index(p.phase))  # stable: PIECES' order within a phase


def find_working(run_try: Callable[[frozenset[str]], Try], time_left: Callable[[], float],
                 report: Callable[[Outcome], None] = lambda outcome: None) -> Outcome:
    """Tries until one passes or time runs out: everything on first; after a failure, each suspect of its phase
    switched off alone (with what is off already), keeping the first that passes or fails later; when none does,
    every piece off. A passing try's tuners that fell back are switched off too (their defaults are what runs).
    `report(outcome)` after every try."""
    outcome = Outcome()

    def attempt(off: frozenset[str]) -> Try:
        outcome.tries.append(run_try(off))
        report(outcome)
        return outcome.tries[-1]

    current = attempt(frozenset())
    while not current.ok and time_left() > 0:
        why = f"failed in {current.phase or 'start-up'}: {current.error}"
        better = None
        for piece in suspects(current.phase, current.off):
            if time_left() <= 0:
                break
            trial = attempt(current.off | {piece.name})
            if trial.ok or trial.reached() > current.reached():
                outcome.off[piece.name], better = why, trial
                break
        if better is None:
            if time_left() <= 0 or len(current.off) == len(PIECES):
                break
            rest = {p.name for p in PIECES} - current.off
            better = attempt(current.off | rest)
            outcome.off.update(dict.fromkeys(sorted(rest), f"{why} (no single piece; all switched off)"))
        current = better
    outcome.ok = current.ok
    if current.ok:
        for name, why in fallen_back(current.tuning or {}).items():
            outcome.off.setdefault(name, why)
    report(outcome)
    return outcome


def fallen_back(tuning: dict) -> dict[str, str]:
    """piece -> why, for each start-up tuner whose report names a device error (it ran on its defaults)."""
    found = {}
    for path, piece in TUNERS:
        part = tuning
        for key in path:
            part = part.get(key) or {}
        if part.get("error"):
            found.setdefault(piece, f"tuning fell back to the defaults: {part['error']}")
    return found


# ---- one try: a fresh process --------------------------------------------------------------------------------
def child_command(args: argparse.Namespace, off: frozenset[str]) -> list[str]:
    cmd = [sys.executable, __file__, "--child", "--model", str(args.model), "--device", args.device]
    cmd += [f"--off={name}" for name in sorted(off)] + [f"--fail={name}" for name in args.fail]
    return cmd


def run_child(args: argparse.Namespace, off: frozenset[str], timeout: float) -> Try:
    """The try in a subprocess, killed at `timeout`; its phases and result read off its output."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(child_command(args, off), capture_output=True, text=True, timeout=max(timeout, 1))
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as expired:
        out, err, rc = _text(expired.stdout), _text(expired.stderr) + "\ntimed out", None
    phases = [line[len(PHASE_MARK):] for line in out.splitlines() if line.startswith(PHASE_MARK)]
    results = [line[len(RESULT_MARK):] for line in out.splitlines() if line.startswith(RESULT_MARK)]
    seconds = time.perf_counter() - t0
    if rc == 0 and results:
        return Try(off, True, phases[-1] if phases else None, tuning=json.loads(results[-1]).get("tuning"),
                   seconds=seconds)
    lines = [line for line in err.splitlines() if line.strip()]
    return Try(off, False, phases[-1] if phases else None, (lines[-1] if lines else f"exit {rc}")[:300],
               seconds=seconds)


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def child(args: argparse.Namespace) -> int:
    """The engine with `--off` pieces off, its phases marked on stdout (and `--fail` raised there); a few tokens."""
    import torch

    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine import build
    from cbatch.engine.engine import run_to_completion
    from cbatch.engine.runner import ModelRunner

    make_model(args.model, args.device)  # here, not in the parent: one process pays torch's and transformers' imports
    off, injected = set(args.off), [BY_NAME[name] for name in args.fail]

    def mark(phase: str) -> None:
        print(f"{PHASE_MARK}{phase}", flush=True)
        for piece in injected:
            if piece.name not in off and PHASES.index(piece.phase) <= PHASES.index(phase):
                raise RuntimeError(f"injected failure of {piece.name} (--fail), in {phase}")

    def marked(phase: str, fn):
        def call(*a, **kw):
            mark(phase)
            return fn(*a, **kw)
        return call

    build.tune_kernels = marked("tuning", build.tune_kernels)
    build._kv_pool = marked("sizing", build._kv_pool)
    ModelRunner.capture_decode_graphs = marked("graphs", ModelRunner.capture_decode_graphs)
    build.warm_up = marked("warm-up", build.warm_up)
    cuda = args.device == "cuda"
    settings = {k: v for name in off for k, v in BY_NAME[name].off.items()}
    # the profile's max_model_len and graph cap: the tuning keys (and so the cache entries) are the later steps'
    config = EngineConfig(model=str(args.model), device=args.device, dtype="bfloat16" if cuda else "float32",
                          max_model_len=2048 if cuda else 64, cuda_graph_max_batch=256 if cuda else None,
                          attention_backend="auto" if cuda else "triton", **settings)
    engine = build.build_engine(config)
    mark("decode")
    rows, tokens = (6, 6) if cuda else (2, 2)  # the CPU dry run's interpreter takes seconds per step
    prompts = [[(7 * i + j) % 500 + 1 for j in range(12 + i)] for i in range(rows)]
    params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.6 * (i % 2), seed=i)
              for i in range(rows)]  # greedy and sampled rows
    outs = run_to_completion(engine, prompts, params)
    if cuda:
        torch.cuda.synchronize()
    if [len(o.token_ids) for o in outs] != [tokens] * rows:
        raise RuntimeError(f"decoded {[len(o.token_ids) for o in outs]} tokens, not {tokens} per request")
    print(RESULT_MARK + json.dumps({"tuning": engine.kernel_tuning}, default=str), flush=True)
    engine.close()
    return 0


# ---- the kit's step ------------------------------------------------------------------------------------------
def make_model(model: Path, device: str) -> None:
    """The try's model: Qwen3-0.6B's shapes with two layers (GPU), the tiny preset (CPU dry run); kept if there."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from make_random_model import main as make

    make("qwen3-0.6b" if device == "cuda" else "tiny", str(model), num_hidden_layers=2)


def describe(outcome: Outcome) -> list[str]:
    """The step's closing lines: what is off and why, or that every piece works."""
    if not outcome.ok:
        last = outcome.tries[-1] if outcome.tries else None
        return [f"first step: no try passed ({len(outcome.tries)} tries; last: "
                f"{'in ' + last.phase + ': ' if last and last.phase else ''}{last.error if last else 'none'})"]
    if not outcome.off:
        return [f"first step: every piece works ({', '.join(p.name for p in PIECES)})"]
    return [f"first step: {name} {why}: switched off for the rest of this call "
            f"({', '.join(f'{k}={json.dumps(v)}' for k, v in BY_NAME[name].off.items())})"
            for name, why in outcome.off.items()]


def write(outcome: Outcome, args: argparse.Namespace) -> None:
    """--json and --switched-off as they stand (rewritten after every try)."""
    doc = {"ok": outcome.ok, "switched_off": outcome.off, "settings": outcome.settings(),
           "tries": [{"off": sorted(t.off), "ok": t.ok, "phase": t.phase, "error": t.error,
                      "seconds": round(t.seconds, 1), "tuning": t.tuning} for t in outcome.tries]}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    if args.switched_off:
        args.switched_off.write_text("".join(f"{k}={json.dumps(v)}\n" for k, v in outcome.settings().items()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the try's checkpoint (made here when missing)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--deadline", type=float, default=40.0, help="seconds for every try together")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--switched-off", type=Path, default=None, help="KEY=VALUE engine settings, one a line")
    p.add_argument("--fail", action="append", default=[], choices=sorted(BY_NAME), help="inject a failure (tests)")
    p.add_argument("--off", action="append", default=[], choices=sorted(BY_NAME), help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    end = time.monotonic() + args.deadline  # this process imports nothing heavy: the tries get the time

    def run_try(off: frozenset[str]) -> Try:
        tried = run_child(args, off, end - time.monotonic())
        verdict = "passed" if tried.ok else f"failed in {tried.phase or 'start-up'}: {tried.error}"
        print(f"first step: try with {', '.join(sorted(off)) or 'every piece'}{' off' if off else ' on'}: {verdict} "
              f"({tried.seconds:.1f} s)", flush=True)
        return tried

    outcome = find_working(run_try, lambda: end - time.monotonic(), lambda o: write(o, args))
    for line in describe(outcome):
        print(line, flush=True)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
