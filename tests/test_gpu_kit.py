"""The GPU kit (benchmarks/gpu_session.sh) and its first step (benchmarks/first_step.py), on CPU: the time plan
leaves its reserve in every part, the first step names a failing piece and switches it off (faults injected into
fake tries, then into real tries on a tiny CPU engine), and the kit passes what was switched off to every later
cbatch run of the call."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "benchmarks" / "gpu_session.sh"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


first_step = _load("first_step")


def kit(script: str, tmp_path: Path) -> str:
    """The kit's functions (sourced, not run), then `script`; its stdout."""
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", "-c", f"source {KIT}; SUMMARY={tmp_path}/summary.txt; {script}"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_every_part_of_the_plan_leaves_its_reserve(tmp_path):
    """--list: every part's worst case (setup, each step's budget + kill grace + archive, finish) leaves >= 60 s
    before the device's 600 s kill, and its steps add up to it; `all` starts with the first step and gives
    profile_fp8 the ~37-48 s it needs with room, the peer 64 requests with a 100 s fallback reserve."""
    listing = kit("main --list", tmp_path)
    parts = re.findall(r"^part (\S+): worst case (\d+) s of its (\d+) s limit, reserve (\d+) s before the "
                       r"device's 600 s kill", listing, re.M)
    assert len(parts) == 18
    for name, worst, limit, reserve in parts:
        assert int(reserve) >= 60 and int(worst) + int(reserve) == 600 and int(worst) <= int(limit), name
        block = listing.split(f"part {name}:")[1].split("\npart ")[0]
        ends = [int(x) for x in re.findall(r"ends by\s+(\d+) s", block)]
        assert ends[-1] == int(worst) and ends == sorted(ends), name
    all_block = listing.split("part all:")[1].split("\npart ")[0]
    steps = re.findall(r"^  (\w+)\s+(\d+) s \+", all_block, re.M)
    assert [s for s, _ in steps][:2] == ["first_step", "make_model"]
    assert int(dict(steps)["profile_fp8"]) >= 60
    assert "on 64 requests" in all_block and "fallback's 100 s" in all_block
    assert "on 256 requests" in listing.split("part peer:")[1].split("\npart ")[0]


def test_the_dry_run_counts_the_files_of_each_part_alone(tmp_path):
    """A device call brings back 8 files and runs one part: the all-parts dry run passes while each part alone
    leaves at most 8 (its figures, its logs, summary.txt), however many they make together, and fails past it."""
    def dry_run(sizes: dict[str, int]) -> subprocess.CompletedProcess:
        fake = "run_part() { local i; for i in $(seq $(eval echo \\$N_${1//-/_})); do echo x > \"$OUT/$1-$i.json\"; done; " \
               "echo x > \"$OUT/$1-logs.tgz\"; }"
        counts = " ".join(f"N_{name.replace('-', '_')}={n}" for name, n in sizes.items())
        return subprocess.run(["bash", "-c", f"source {KIT}; {counts}; {fake}; main --cpu-dry-run {' '.join(sizes)}"],
                              capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path / str(len(sizes)))},
                              timeout=60)

    passed = dry_run({"all": 4, "vision": 2, "spec": 2})  # 8 figures in all, at most 6 files a part
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "a part alone leaves at most 6 file(s) in $OUT (part all; limit 8)" in passed.stdout
    failed = dry_run({"all": 7, "e2e-gemm": 1})
    assert failed.returncode != 0 and "at most 9 file(s) in $OUT (part all; limit 8)" in failed.stdout


def test_the_switched_off_pieces_reach_every_later_run(tmp_path):
    """What the first step wrote goes into gpu_profile's and compare_peers' cbatch settings, on the GPU and in
    the dry run; the peer in `all` compares 64 requests with its JSON in $OUT."""
    off = tmp_path / "off.txt"
    off.write_text("split_sampler=false\nenforce_eager=true\n")
    out = kit(f"load_switched_off {off}; DRY=0; echo \"P $(profile_args)\"; echo \"E $(e2e_args)\"; "
              f"echo \"A $(peer_args 204 $ALL_PEER_REQUESTS)\"; DRY=1; echo \"D $(profile_args)\"", tmp_path)
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line[:2] in ("P ", "E ", "A ", "D "))
    for key in ("P", "D"):
        assert "--engine-arg split_sampler=false --engine-arg enforce_eager=true" in lines[key]
    for key in ("E", "A"):
        assert "--engine-arg cbatch:split_sampler=false --engine-arg cbatch:enforce_eager=true" in lines[key]
    assert "--num-requests 64 " in lines["A"] and "--fallback-reserve 100 " in lines["A"]
    assert f"--json {tmp_path}/hf_vs_cbatch.json" in lines["A"] and "--deadline 199 " in lines["A"]
    assert "switched off for the rest of this call (first step): split_sampler=false enforce_eager=true" in \
        (tmp_path / "summary.txt").read_text()
    nothing = kit(f"load_switched_off {tmp_path}/missing.txt; DRY=0; profile_args", tmp_path)
    assert "--engine-arg" in nothing and "split_sampler" not in nothing


class FakeDevice:
    """run_try for find_working: each named piece fails (while on) at the phase where it first runs."""

    def __init__(self, *failing: str) -> None:
        self.failing = [first_step.BY_NAME[name] for name in failing]
        self.tried: list[frozenset[str]] = []

    def __call__(self, off: frozenset[str]) -> first_step.Try:
        self.tried.append(off)
        broken = [p for p in self.failing if p.name not in off]
        if not broken:
            return first_step.Try(off, True, "decode", tuning={})
        phase = min(broken, key=lambda p: first_step.PHASES.index(p.phase)).phase
        return first_step.Try(off, False, phase, f"RuntimeError: {phase} broke")


@pytest.mark.parametrize("piece", [p.name for p in first_step.PIECES])
def test_the_first_step_finds_the_failing_piece(piece):
    """One piece fails: it alone is switched off, found among its phase's suspects (that phase's pieces first,
    then earlier ones), each tried alone in one more process."""
    device = FakeDevice(piece)
    outcome = first_step.find_working(device, lambda: 100.0)
    assert outcome.ok and list(outcome.off) == [piece]
    phase = first_step.BY_NAME[piece].phase
    assert outcome.off[piece] == f"failed in {phase}: RuntimeError: {phase} broke"
    order = [p.name for p in first_step.suspects(phase, set())]
    assert device.tried == [frozenset()] + [frozenset({name}) for name in order[: order.index(piece) + 1]]
    assert outcome.settings() == first_step.BY_NAME[piece].off


def test_the_first_step_suspects_run_from_the_failing_phase_back():
    assert [p.name for p in first_step.suspects("graphs", set())] == [
        "decode_gemm", "cuda_graphs", "split_kv", "fp32_logits", "split_sampler", "kernel_tuning"]
    assert [p.name for p in first_step.suspects("sizing", {"fp32_logits"})] == [
        "split_kv", "split_sampler", "kernel_tuning"]
    assert [p.name for p in first_step.suspects(None, set())][:2] == ["decode_gemm", "cuda_graphs"]


def test_two_failing_pieces_are_both_switched_off():
    """The first fix moves the failure to a later phase (progress): kept, then the second culprit is found."""
    device = FakeDevice("split_sampler", "cuda_graphs")
    outcome = first_step.find_working(device, lambda: 100.0)
    assert outcome.ok and set(outcome.off) == {"split_sampler", "cuda_graphs"}
    assert device.tried[-1] == frozenset({"split_sampler", "cuda_graphs"})


def test_an_engine_broken_whatever_is_off_and_a_deadline():
    """No single piece helps: every piece off, one more try, and the outcome says none passed; with no time
    left after the first try nothing more is tried."""
    def always_fails(off):
        return first_step.Try(off, False, "tuning", "RuntimeError: no device")

    outcome = first_step.find_working(always_fails, lambda: 100.0)
    assert not outcome.ok and set(outcome.off) == {p.name for p in first_step.PIECES}
    assert len(outcome.tries) == 1 + 1 + 1  # everything on; kernel_tuning alone (the only suspect); all off
    assert "no try passed" in first_step.describe(outcome)[0]
    hurried = first_step.find_working(always_fails, lambda: 0.0)
    assert len(hurried.tries) == 1 and not hurried.ok and hurried.off == {}


def test_a_tuner_that_fell_back_is_named_and_switched_off():
    """A passing try whose report says the GEMM tuner met a device error: decode_gemm off, with its reason."""
    tuning = {"decode_attention": "x", "kv_splits": {"rule": "r"}, "decode_gemm": {"error": "RuntimeError: capture"}}
    outcome = first_step.find_working(lambda off: first_step.Try(off, True, "decode", tuning=tuning), lambda: 1.0)
    assert outcome.ok and outcome.off == {"decode_gemm": "tuning fell back to the defaults: RuntimeError: capture"}
    assert first_step.describe(outcome) == ["first step: decode_gemm tuning fell back to the defaults: RuntimeError: "
                                           "capture: switched off for the rest of this call (decode_gemm=false)"]
    assert first_step.fallen_back({"error": "E", "kv_splits": {"error": "F"}}) == {
        "kernel_tuning": "tuning fell back to the defaults: E"}


def test_the_first_step_on_a_cpu_engine_with_an_injected_failure(tmp_path):
    """Real tries (fresh processes, a tiny engine on the Triton interpreter): split_kv made to fail where it first
    runs; the first try fails in `sizing`, the second (split_kv off) passes, and the files the kit reads say so."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out, off = tmp_path / "first_step.json", tmp_path / "off.txt"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "first_step.py"), "--device", "cpu",
                           "--model", str(tmp_path / "model"), "--deadline", "600", "--fail", "split_kv",
                           "--json", str(out), "--switched-off", str(off)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert [(t["ok"], t["phase"], t["off"]) for t in doc["tries"]] == [(False, "sizing", []),
                                                                      (True, "decode", ["split_kv"])]
    assert "injected failure of split_kv" in doc["tries"][0]["error"]
    assert off.read_text() == "split_kv=false\n" and doc["settings"] == {"split_kv": False}
    assert "first step: split_kv failed in sizing: RuntimeError: injected failure of split_kv" in proc.stdout


def test_the_host_step_script_runs_on_this_engine(tmp_path):
    """The kit's `host_step` (benchmarks/host_overhead.py) mirrors the runner's host part: when the runner's step
    inputs change shape it must change with them, or the device call loses the step's figures."""
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--cpu-time", "--running", "4",
                           "--steps", "2", "--prompt-len", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| sync | 4 |" in proc.stdout and "| async | 4 |" in proc.stdout
    assert out.is_file()
