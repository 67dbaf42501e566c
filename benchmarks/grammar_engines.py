"""xgrammar against llguidance on one nested JSON schema with SmolLM2's tokenizer, in one process.

Usage: PYTHONPATH=. python benchmarks/grammar_engines.py [--repeats 5]

Needs both libraries (`pip install xgrammar llguidance`; cbatch depends on xgrammar only). For each:
the tokenizer's preparation, the schema's compile time, and per token of a fixed 100-odd-token JSON
document the time to fill the next-token bitmask and to advance the matcher (min over repeats). The
comparison that chose xgrammar is in docs/structured-output.md; absolute figures depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import time

from cbatch.model.default_model import default_model_dir
from cbatch.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"]}}, "required": ["city", "geo"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "object", "properties": {
            "k": {"enum": ["a", "b"]}, "v": {"type": "integer"}}, "required": ["k", "v"]}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "scores", "active"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "role": "admin",
            "address": {"city": "London", "zip": "W1", "geo": {"lat": 51.5, "lon": -0.12}},
            "tags": ["math", "poetry", "engines"], "scores": [{"k": "a", "v": 10}, {"k": "b", "v": 7}], "active": True}
VOCAB = 49152


def best_of(repeats: int, fn):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def xgrammar_run(tokenizer, token_ids: list[int], repeats: int) -> dict[str, float]:
    import xgrammar as xgr

    prep, info = best_of(1, lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB,
                                                                         stop_token_ids=[tokenizer.eos_token_id]))
    schema = json.dumps(SCHEMA)
    compile_s, compiled = best_of(repeats, lambda: xgr.GrammarCompiler(info, cache_enabled=False)
                                  .compile_json_schema(schema, any_whitespace=False))
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    return {"tokenizer prep s": prep, "compile s": compile_s, **per_token(
        token_ids, repeats, lambda: xgr.GrammarMatcher(compiled), lambda m: m.fill_next_token_bitmask(bitmask, 0),
        lambda m, t: m.accept_token(t), lambda m: m.is_terminated())}


def llguidance_run(tokenizer, token_ids: list[int], repeats: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    prep, lltok = best_of(1, lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB))
    defaults = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def build():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=defaults)
        matcher = llguidance.LLMatcher(lltok, grammar)  # llguidance builds lazily: the matcher is its compile
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    compile_s, grammar = best_of(repeats, build)
    bitmask = lt.allocate_token_bitmask(1, VOCAB)
    return {"tokenizer prep s": prep, "compile s": compile_s, **per_token(
        token_ids, repeats, lambda: llguidance.LLMatcher(lltok, grammar), lambda m: lt.fill_next_token_bitmask(m, bitmask, 0),
        lambda m, t: m.consume_token(t), lambda m: m.is_stopped())}


def per_token(token_ids: list[int], repeats: int, new_matcher, fill, advance, finished) -> dict[str, float]:
    """Walks the document's tokens with a fresh matcher `repeats` times: min mask-fill and advance time per token."""
    fills, advances = [], []
    for _ in range(repeats):
        matcher, fill_s, advance_s = new_matcher(), 0.0, 0.0
        for token in token_ids:
            t0 = time.perf_counter()
            fill(matcher)
            t1 = time.perf_counter()
            assert advance(matcher, token), token
            advance_s += time.perf_counter() - t1
            fill_s += t1 - t0
        assert finished(matcher)
        fills.append(fill_s)
        advances.append(advance_s)
    return {"mask fill s/token": min(fills) / len(token_ids), "advance s/token": min(advances) / len(token_ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tokenizer = load_tokenizer(default_model_dir())
    token_ids = tokenizer.encode(json.dumps(DOCUMENT)) + [tokenizer.eos_token_id]
    results = {"xgrammar": xgrammar_run(tokenizer, token_ids, args.repeats),
               "llguidance": llguidance_run(tokenizer, token_ids, args.repeats)}
    print(f"{len(token_ids)} tokens; min over {args.repeats} repeats")
    for metric in results["xgrammar"]:
        x, g = results["xgrammar"][metric], results["llguidance"][metric]
        print(f"{metric:>18}: xgrammar {x * 1e6:10.1f} us  llguidance {g * 1e6:10.1f} us  llguidance/xgrammar {g / x:6.2f}")


if __name__ == "__main__":
    main()
