"""vLLM's run-batch test cases through `cbatch run` (benchmarks/vllm_batch_cases.py): each case's lines run on a
tiny local model with --output-format vllm, every output line is held to BatchRequestOutput's structure and, with
--vllm-python, validated by vLLM's own pydantic model in that interpreter (`benchmarks/setup_peers.sh vllm ROOT`
makes one: ROOT/vllm/bin/python); then the case's assertions. One PASS/FAIL line per case; exit 1 if any fails.

    python benchmarks/vllm_batch_check.py --vllm-python ~/.cache/cbatch/peers/vllm/bin/python
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # cbatch from this checkout, whatever the cwd
sys.path.insert(0, str(ROOT / "benchmarks"))

from vllm_batch_cases import (cases, check_structure, make_models, read_lines, run_args,  # noqa: E402
                              validate_with_vllm, write_case)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="a python with vllm installed: validate every line with its model "
                        "(default: setup_peers.sh's default venv, ~/.cache/cbatch/peers/vllm, where it exists)")
    parser.add_argument("--tokenizer-dir", type=Path, help="the models' tokenizer (default: the default model's, SmolLM2)")
    parser.add_argument("--keep", type=Path, help="write the models, inputs and outputs here (default: a temp folder)")
    parser.add_argument("--case", action="append", help="run only these cases (by name; repeatable)")
    args = parser.parse_args()
    default_venv = Path.home() / ".cache/cbatch/peers/vllm/bin/python"
    if args.vllm_python is None and default_venv.exists():
        args.vllm_python = str(default_venv)
    if args.tokenizer_dir is None:
        from cbatch.model.default_model import default_model_dir

        args.tokenizer_dir = default_model_dir()
    with tempfile.TemporaryDirectory() as temp:
        root = args.keep or Path(temp)
        models = make_models(root / "models", args.tokenizer_dir)
        selected = [c for c in cases() if not args.case or c.name in args.case]
        results: dict[str, list[str]] = {}
        outputs = {}
        for case in selected:
            source, out = write_case(case, root / "inputs"), root / "outputs" / f"{case.name}.jsonl"
            out.parent.mkdir(parents=True, exist_ok=True)
            done = subprocess.run([sys.executable, "-m", "cbatch.cli", *run_args(case, source, out, models[case.model]),
                                   "--overwrite"], capture_output=True, text=True, cwd=ROOT)
            lines = read_lines(out)
            problems = [f"line {i + 1}: {p}" for i, line in enumerate(lines) for p in check_structure(line)]
            problems += case.check(done.returncode, lines)
            if done.returncode not in (0, 1):
                problems.append(f"cbatch exited {done.returncode}: {done.stderr.strip()[-300:]}")
            results[case.name], outputs[case.name] = problems, out
        if args.vllm_python:
            found = validate_with_vllm(args.vllm_python, [p for p in outputs.values() if p.exists()])
            for name, path in outputs.items():
                results[name] += [f"vLLM's BatchRequestOutput: {p}" for p in found.get(str(path), [])]
        for name, problems in results.items():
            print(f"{'PASS' if not problems else 'FAIL'} {name}" + "".join(f"\n    {p}" for p in problems))
        checked = "vLLM's BatchRequestOutput and " if args.vllm_python else ""
        print(f"{sum(not p for p in results.values())}/{len(results)} cases pass ({checked}the structure check)")
        return 0 if all(not p for p in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
