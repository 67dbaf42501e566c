"""vLLM's own run-batch test cases (vllm-project/vllm tests/entrypoints/openai/test_run_batch.py: completions, invalid
input, embeddings, score, rerank, tool calling; audio aside) as cbatch runs them, on tiny local models.

The request lines are our own, written in the shapes those tests send (the same urls, body fields and custom_ids;
texts of our own). Each `Case` names its model, its lines, the flags cbatch needs, the exit code vLLM's test asserts
and the assertions it makes on the output lines; `check_structure` holds every output line to the structure of
vLLM's `BatchRequestOutput` without vLLM installed, and `vllm_validator` / `validate_with_vllm` use vLLM's own
pydantic model where vLLM is importable (benchmarks/setup_peers.sh vllm installs it in a side venv).

Where cbatch differs from `vllm run-batch` by design, the case says so in `flags`:
- a job with error rows exits 1 (vLLM: 0); the cases whose file holds bad lines run with --allow-errors;
- two lines with one custom_id are refused unless --allow-duplicate-ids (vLLM's rerank file repeats "request-2");
- an LM-head reranker needs its classifier tokens (--classifier-from-token), as vLLM needs `hf_overrides`.
Used by benchmarks/vllm_batch_check.py (every case through `cbatch run`, PASS/FAIL each) and
tests/test_vllm_batch_cases.py (the same cases in CI).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

TESTS = Path(__file__).resolve().parent.parent / "tests"  # the tiny-model builders the test suite uses

CHAT_URL = "/v1/chat/completions"
QUESTION = "Which city is the capital of France?"
DOCUMENTS = ["Brasilia is the capital city of Brazil.", "Paris is the capital city of France."]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_current_weather", "description": "The weather now at a place",
    "parameters": {"type": "object", "properties": {
        # (bounded: a random model's string would otherwise run to max_tokens, leaving no call to parse)
        "location": {"type": "string", "description": "A city and its state", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}

Check = Callable[[int, list[dict[str, Any]]], list[str]]  # (exit code, output lines) -> what failed


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # a key of `make_models`
    lines: list[dict[str, Any]]
    flags: tuple[str, ...] = ()
    check: Check = field(default=lambda code, lines: [])


def line(custom_id: str, url: str, body: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **top}


def chat_body(model: str, system: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": "Hello there!"}], "max_tokens": 12, **extra}


# ---- the assertions of vLLM's tests ---------------------------------------------------------------------------
def exit_code(wanted: str) -> Check:
    """vLLM's `returncode == 0` ("zero") or `!= 0` ("nonzero")."""
    def check(code: int, lines: list[dict[str, Any]]) -> list[str]:
        ok = code == 0 if wanted == "zero" else code != 0
        return [] if ok else [f"exit code {code}, vLLM's test wants {wanted}"]
    return check


def no_errors(code: int, lines: list[dict[str, Any]]) -> list[str]:
    """vLLM's `line["error"] is None` on every line."""
    return [f"{out['custom_id']}: error {out['error']}" for out in lines if out.get("error") is not None]


def every(*checks: Check) -> Check:
    return lambda code, lines: [problem for check in checks for problem in check(code, lines)]


def count(n: int) -> Check:
    return lambda code, lines: [] if len(lines) == n else [f"{len(lines)} output lines, expected {n}"]


def errors_for(*custom_ids: str) -> Check:
    """These lines are error lines (status >= 400, `error` set), the others are not."""
    def check(code: int, lines: list[dict[str, Any]]) -> list[str]:
        failed = {out["custom_id"] for out in lines if out["error"] is not None}
        return [] if failed == set(custom_ids) else [f"error lines {sorted(failed)}, expected {sorted(custom_ids)}"]
    return check


def scored(per_line: int, key: str) -> Check:
    """Each line's body holds `per_line` scores under `key` (score: `data`; rerank: `results`)."""
    def check(code: int, lines: list[dict[str, Any]]) -> list[str]:
        return [f"{out['custom_id']}: {key} has {len(items)} items, expected {per_line}" for out in lines
                if out["error"] is None and len(items := out["response"]["body"][key]) != per_line]
    return check


def called_weather(code: int, lines: list[dict[str, Any]]) -> list[str]:
    """vLLM's test_tool_calling: `tool_calls` non-empty, each an id, type "function", a function named
    get_current_weather with its arguments."""
    problems = []
    for out in lines:
        if out["error"] is not None:
            continue
        calls = out["response"]["body"]["choices"][0]["message"].get("tool_calls")
        if not isinstance(calls, list) or not calls:
            problems.append(f"{out['custom_id']}: no tool_calls")
            continue
        for call in calls:
            fn = call.get("function") or {}
            if not ("id" in call and call.get("type") == "function" and fn.get("name") == "get_current_weather"
                    and "arguments" in fn):
                problems.append(f"{out['custom_id']}: not a get_current_weather call: {call}")
    return problems


def output_empty(code: int, lines: list[dict[str, Any]]) -> list[str]:
    return [] if not lines else [f"{len(lines)} output lines, expected none"]


# ---- the cases -------------------------------------------------------------------------------------------------
def cases() -> list[Case]:
    completions = [line("request-1", CHAT_URL, chat_body("tiny-chat", "You help.")),
                   line("request-2", CHAT_URL, chat_body("tiny-chat", "You do not help.")),
                   line("request-3", CHAT_URL, chat_body("NonExistModel", "You do not help.")),
                   line("request-4", "/bad_url", chat_body("tiny-chat", "You do not help.")),
                   line("request-5", CHAT_URL, chat_body("tiny-chat", "You do not help.", stream="True"))]
    invalid = [{"invalid_field": "request-1", "method": "POST", "url": CHAT_URL, "body": chat_body("tiny-chat", "You help.")},
               line("request-2", CHAT_URL, chat_body("tiny-chat", "You do not help."))]
    embeddings = [line(f"request-{i}", "/v1/embeddings", {"model": model, "input": text}) for i, (model, text) in
                  enumerate([("tiny-embed", "You help."), ("tiny-embed", "You do not help."),
                              ("tiny-embed", "Hello there!"), ("NonExistModel", "Hello there!")], start=1)]
    score = [line(f"request-{i}", url, {"model": "tiny-reranker", "queries": QUESTION, "documents": DOCUMENTS})
             for i, url in enumerate(("/score", "/v1/score"), start=1)]
    rerank = [line(cid, url, {"model": "tiny-reranker", "query": QUESTION, "documents": DOCUMENTS})
              for cid, url in (("request-1", "/rerank"), ("request-2", "/v1/rerank"), ("request-2", "/v2/rerank"))]
    tools = [line("request-1", CHAT_URL, {"model": "tiny-tools", "messages": [
        {"role": "user", "content": "What is the weather like in San Francisco?"}], "tools": [WEATHER_TOOL],
        "tool_choice": "required", "max_tokens": 200})]
    lm_head = ("--classifier-from-token", "no,yes")
    return [
        Case("empty_file", "chat", [], check=every(exit_code("zero"), output_empty)),
        Case("completions", "chat", completions, ("--allow-errors",),
             every(exit_code("zero"), count(5), errors_for("request-4", "request-5"))),
        Case("completions_invalid_input", "chat", invalid, check=exit_code("nonzero")),
        Case("embeddings", "embed", embeddings, ("--task", "embed", "--pooling", "last", "--normalize"),
             every(exit_code("zero"), count(4), no_errors)),
        Case("score", "cross", score, ("--task", "score"), every(exit_code("zero"), count(2), no_errors, scored(2, "data"))),
        Case("rerank", "cross", rerank, ("--task", "rerank", "--allow-duplicate-ids"),
             every(exit_code("zero"), count(3), no_errors, scored(2, "results"))),
        Case("score_lm_head_reranker", "lm_reranker", score, ("--task", "score", *lm_head),
             every(exit_code("zero"), count(2), no_errors, scored(2, "data"))),
        Case("rerank_lm_head_reranker", "lm_reranker", rerank, ("--task", "rerank", "--allow-duplicate-ids", *lm_head),
             every(exit_code("zero"), count(3), no_errors, scored(2, "results"))),
        Case("tool_calling", "tools", tools, ("--tool-call-parser", "hermes"),
             every(exit_code("zero"), count(1), no_errors, called_weather)),
    ]


# ---- models ----------------------------------------------------------------------------------------------------
def make_models(root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """The tiny random checkpoints the cases run, each with `tokenizer_dir`'s tokenizer (SmolLM2's: real words, a
    chat template, "yes" and "no" tokens): chat (Llama), embed (a bare Qwen3 decoder), cross (a one-label
    LlamaForSequenceClassification), lm_reranker (a Qwen3ForCausalLM), tools (Qwen3 with a Hermes tool template)."""
    import torch
    import transformers

    sys.path.insert(0, str(TESTS))
    from tiny_models import BASE, make_checkpoint
    from tool_models import make_hermes_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = {**BASE, "vocab_size": len(tokenizer), "tie_word_embeddings": False}
    paths = {name: root / name for name in ("chat", "embed", "cross", "lm_reranker", "tools")}
    make_checkpoint("llama", paths["chat"], seed=1, vocab_size=len(tokenizer))
    make_checkpoint("qwen3", paths["lm_reranker"], seed=2, vocab_size=len(tokenizer))
    torch.manual_seed(3)
    transformers.AutoModel.from_config(transformers.Qwen3Config(**config)).save_pretrained(paths["embed"])
    torch.manual_seed(4)
    transformers.AutoModelForSequenceClassification.from_config(
        transformers.LlamaConfig(**config, num_labels=1)).save_pretrained(paths["cross"])
    for name in ("chat", "embed", "cross", "lm_reranker"):
        tokenizer.save_pretrained(paths[name])
        (paths[name] / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    make_hermes_model(paths["tools"], tokenizer_dir)
    return paths


def write_case(case: Case, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{case.name}.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in case.lines))
    return path


def run_args(case: Case, source: Path, out: Path, model: Path) -> list[str]:
    """`cbatch run`'s arguments for the case, writing vLLM's output lines."""
    return ["run", str(source), "--out", str(out), "--model", str(model), "--output-format", "vllm", "--device", "cpu",
            "--display", "none", "--quiet", *case.flags]


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


# ---- BatchRequestOutput's structure, without vLLM ----------------------------------------------------------------
def check_structure(out: dict[str, Any]) -> list[str]:
    """What vLLM's `BatchRequestOutput` (id, custom_id, response: {status_code, request_id, body}, error) and the
    response bodies it takes (chat completion, embeddings, score, rerank) require of a line; [] when it holds."""
    problems = []
    if set(out) != {"id", "custom_id", "response", "error"}:
        problems.append(f"keys {sorted(out)}")
    for key in ("id", "custom_id"):
        if not isinstance(out.get(key), str):
            problems.append(f"{key} not a string")
    response = out.get("response")
    if response is None:
        return problems
    if not isinstance(response.get("status_code"), int) or not isinstance(response.get("request_id"), str):
        problems.append("response without an integer status_code and a string request_id")
    body = response.get("body")
    if body is None:
        if out.get("error") is None:
            problems.append("neither a body nor an error")
        return problems
    if out.get("error") is not None:
        problems.append("a body and an error")
    return problems + _body_problems(body)


def _body_problems(body: dict[str, Any]) -> list[str]:
    def need(cond: bool, what: str) -> list[str]:
        return [] if cond else [what]

    if body.get("object") == "chat.completion":
        choices = body.get("choices")
        problems = need(isinstance(choices, list) and choices, "chat completion without choices")
        for choice in choices or []:
            message = choice.get("message") or {}
            problems += need(message.get("role") == "assistant", "a choice's message is not the assistant's")
            problems += need(message.get("content") is None or isinstance(message["content"], str), "content not text")
            for call in message.get("tool_calls") or []:
                fn = call.get("function") or {}
                problems += need(isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str),
                                 f"a tool call without a name and string arguments: {call}")
        usage = body.get("usage") or {}
        return problems + need(all(isinstance(usage.get(k), int) for k in ("prompt_tokens", "total_tokens")), "usage")
    if "results" in body:  # rerank: vLLM's RerankResponse wants each result's document and both token counts
        usage = body.get("usage") or {}
        problems = need(all(isinstance(usage.get(k), int) for k in ("prompt_tokens", "total_tokens")), "rerank usage")
        return problems + [p for r in body["results"] for p in need(
            isinstance(r.get("index"), int) and isinstance(r.get("relevance_score"), float)
            and isinstance(r.get("document"), dict), f"rerank result {r}")]
    data = body.get("data")
    if body.get("object") != "list" or not isinstance(data, list) or not data:
        return ["a body that is no chat completion, rerank or list of data"]
    problems = []
    for item in data:
        if item.get("object") == "embedding":
            problems += need(all(isinstance(v, float) for v in item.get("embedding") or [None]), "embedding values")
        elif item.get("object") == "score":
            problems += need(isinstance(item.get("score"), float), "score value")
        else:
            problems.append(f"data item of object {item.get('object')!r}")
    return problems


# ---- vLLM's own model ----------------------------------------------------------------------------------------------
VLLM_VALIDATE = r"""
import json, sys
try:
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput  # vLLM 0.3x
except ImportError:
    from vllm.entrypoints.openai.run_batch import BatchRequestOutput  # earlier releases
problems = {}
for path in sys.argv[1:]:
    for i, text in enumerate(open(path).read().splitlines()):
        if text.strip():
            try:
                BatchRequestOutput.model_validate_json(text)
            except Exception as exc:
                problems.setdefault(path, []).append(f"line {i + 1}: {exc}")
print(json.dumps(problems))
"""


def vllm_validator() -> Callable[[str], None] | None:
    """`BatchRequestOutput.model_validate_json` of the vLLM importable here, or None."""
    try:
        from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
    except ImportError:
        try:
            from vllm.entrypoints.openai.run_batch import BatchRequestOutput
        except ImportError:
            return None
    return BatchRequestOutput.model_validate_json


def validate_with_vllm(python: str, paths: list[Path]) -> dict[str, list[str]]:
    """Every line of `paths` validated with vLLM's `BatchRequestOutput` by `python` (a venv with vLLM):
    {path: its problems} for the files with any. Raises RuntimeError when that python cannot import vLLM."""
    done = subprocess.run([python, "-c", VLLM_VALIDATE, *map(str, paths)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{python} could not validate with vLLM: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


__all__ = ["Case", "cases", "check_structure", "make_models", "read_lines", "run_args", "validate_with_vllm",
           "vllm_validator", "write_case"]
