"""Speculative decoding never changes a token (docs/speculative.md): with --speculative ngram | suffix | auto every
row's tokens (and log-probabilities) equal the plain run's, for greedy and seeded sampled rows, penalties, n > 1,
stop strings, grammars, chunked prefill and preemption; and drafts really were accepted (no vacuous pass)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from cbatch.config import ConfigError, Constraint, EngineConfig, SamplingParams
from cbatch.engine.engine import run_to_completion
from cbatch.engine.sequence import Sequence
from cbatch.engine.speculative import Speculator, StepCost
from cbatch.engine.speculative.ngram import NgramIndex, copy_from
from cbatch.engine.speculative.suffix import SuffixTable
from cbatch.observe.report import speculation
from cbatch.tokenizer import load_tokenizer
from helpers import make_engine, random_prompts

VOCAB = 384


def outputs(engine, prompts, params):
    per_row = params if isinstance(params, list) else [params] * len(prompts)
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in run_to_completion(engine, prompts, per_row)]


def repeated_job(rows: int = 4, seed: int = 0) -> list[list[int]]:
    """Each prompt twice, the copies after all the originals: with fcfs and `rows` slots the copies start once the
    originals finished, so the job's own outputs (suffix decoding) draft theirs."""
    base = random_prompts(rows, VOCAB, seed=seed, min_len=5, max_len=30)
    return base + base


def check_same(path, prompts, params, mode: str, min_accepted: int = 1, reference=None, **settings):
    """Runs the job plain (or takes `reference`: its (outputs, steps)) and with `mode`; asserts identical outputs,
    accepted drafts and every block back. Returns (the plain outputs, the speculative engine)."""
    settings = {"max_num_seqs": 4, "policy": "fcfs", **settings}
    if reference is None:
        plain_engine = make_engine(path, **settings)
        reference = outputs(plain_engine, prompts, params), plain_engine.scheduler.stats.steps
    plain = reference[0]
    engine = make_engine(path, speculative=mode, **settings)
    engine.plain_steps = reference[1]
    assert outputs(engine, prompts, params) == plain
    stats = engine.scheduler.stats
    assert stats.accepted_tokens >= min_accepted, (stats.drafted_tokens, stats.accepted_tokens)
    assert stats.accepted_tokens <= stats.drafted_tokens
    assert engine.pool.num_free == engine.pool.num_blocks  # every block came back, trimmed ones included
    return plain, engine


GREEDY = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3)
SAMPLED = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, seed=7,
                         logprobs=2)
PENALIZED = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=3, repetition_penalty=1.3,
                           frequency_penalty=0.4, presence_penalty=0.2, min_tokens=10, logit_bias={5: 2.0, 9: -1.0},
                           logprobs=1)
SAMPLES = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=11, n=3, logprobs=1)
MIXED = [GREEDY, SAMPLED, PENALIZED, SAMPLES] * 2  # (row i and its copy, row i + 4, share their settings)


@pytest.fixture(scope="module")
def mixed_reference(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"], max_num_seqs=4, policy="fcfs")
    return outputs(engine, repeated_job(), MIXED), engine.scheduler.stats.steps


@pytest.mark.parametrize("mode", ["suffix", "auto"])
def test_tokens_and_logprobs_identical(tiny_checkpoints, mixed_reference, mode):
    """Greedy, seeded top-p/top-k/min-p, penalties + min_tokens + logit_bias, and n = 3 rows (each sample its own
    row, seeded by (row seed, i)) in one job: the copies draft from the originals' outputs."""
    plain, engine = check_same(tiny_checkpoints["llama"], repeated_job(), MIXED, mode, reference=mixed_reference)
    assert engine.scheduler.stats.steps < engine.plain_steps  # the copies took fewer steps
    assert all(logprobs is not None and len(logprobs) == len(tokens) for tokens, logprobs, _ in plain)
    report = speculation(engine.scheduler.stats, sum(len(tokens) for tokens, _, _ in plain))
    assert 0 < report["acceptance_rate"] <= 1 and report["accepted_tokens"] > 0
    assert report["output_tokens_per_step"] > sum(len(t) for t, _, _ in plain) / engine.plain_steps


def test_chunked_prefill(tiny_checkpoints):
    check_same(tiny_checkpoints["llama"], repeated_job(3), SAMPLED, "suffix", max_num_batched_tokens=7, max_num_seqs=3)


def test_asynchronous_scheduling(tiny_checkpoints):
    """A step with drafts is never scheduled ahead of (its tokens decide the next drafts); around it steps are."""
    check_same(tiny_checkpoints["llama"], repeated_job(3), GREEDY, "suffix", max_num_seqs=3, async_scheduling=True)


def test_preemption(tiny_checkpoints):
    """Tokens only: a recomputed row's KV comes from a prefill chunk, which is not bitwise the decode steps' KV, so
    log-probabilities after a preemption differ in their last bits with or without speculation (the plain engine's
    own limit: its tokens here are the same)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    _, engine = check_same(tiny_checkpoints["llama"], repeated_job(3), params, "suffix", num_kv_blocks=14,
                           block_size=4, max_num_seqs=3)
    assert engine.scheduler.stats.preemptions > 0


@pytest.fixture(scope="module")
def looping_model(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny llama with its attention outputs scaled down: its greedy text falls into loops within a few dozen
    tokens (the row's own n-grams predict them), while every layer still attends."""
    path = tmp_path_factory.mktemp("looping") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    weights = load_file(path / "model.safetensors")
    save_file({k: v * 0.02 if "o_proj" in k else v for k, v in weights.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    return path


def test_ngram_drafts_from_the_row_itself(looping_model):
    prompts = random_prompts(4, VOCAB, seed=0, min_len=5, max_len=30)
    params = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=1)
    check_same(looping_model, prompts, params, "ngram", min_accepted=5, max_num_seqs=4)


def test_stop_strings_and_grammar_rows(tiny_chat_model, monkeypatch):
    """Stop strings checked per kept token; a grammar's mask at each drafted position is the matcher's after the
    drafts before it (xgrammar fork), advanced for real only by the kept tokens."""
    choice = Constraint("choice", json.dumps(["alpha beta alpha beta", "gamma delta", "alpha beta gamma"]), "choice")
    schema = Constraint("json_schema", json.dumps({"type": "object", "properties": {
        "k": {"enum": ["xyz", "abc"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["k", "n"]}), "json_schema")
    prompts = random_prompts(3, 49152, seed=4, min_len=3, max_len=12) * 2
    # a stop string the first row meets part-way: the text of its 9th and 10th tokens without one
    free = run_to_completion(make_engine(tiny_chat_model), prompts[:1], [SamplingParams(max_tokens=10, seed=5,
                                                                                         temperature=0.9)])[0]
    stop = load_tokenizer(tiny_chat_model).decode(free.token_ids[8:10]).strip() or "e"
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=5, stop=[stop]),
              SamplingParams(max_tokens=12, constraint=choice),
              SamplingParams(max_tokens=16, temperature=0.7, seed=2, constraint=schema)] * 2
    kept: dict[str, int] = {}  # accepted drafts by kind of row
    verified = Speculator.verified

    def count(self, seq, drafted, accepted):
        kind = "grammar" if seq.grammar is not None else "stop" if seq.stop is not None else "plain"
        kept[kind] = kept.get(kind, 0) + accepted
        verified(self, seq, drafted, accepted)

    monkeypatch.setattr(Speculator, "verified", count)
    plain, _ = check_same(tiny_chat_model, prompts, params, "suffix", max_num_seqs=3)
    assert plain[0][2] == "stop" and len(plain[0][0]) >= 4
    assert kept.get("grammar", 0) > 0 and kept.get("stop", 0) > 0, kept


def test_identity_fields_and_refusals():
    from dataclasses import fields

    for f in fields(EngineConfig):
        if f.name.startswith("speculative"):
            assert "output" not in f.metadata  # never part of the resume fingerprint or the result-cache key
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(speculative="medusa")
    EngineConfig(speculative="ngram", loras=(("a", "/x"),))  # adapter rows do not draft; base rows do (test_lora.py)


def test_a_row_matmul_is_the_same_bits_alone_or_in_a_batch():
    """oneDNN sums a one-row product in another order from K ~ 1024 on: `packed_linear` runs one row as two, so a
    lone row's step (a job's last row; plain decoding) equals the same row among others (verify rows, batches)."""
    import torch

    from cbatch.model import onednn

    torch.manual_seed(0)
    weight, x = torch.randn(64, 1536), torch.randn(5, 1536)
    packed = onednn.prepack_weight(weight)
    if packed is None:
        pytest.skip("oneDNN prepacking is not available here")
    alone = onednn.packed_linear(x[:1], packed)
    assert all(torch.equal(onednn.packed_linear(x[:m], packed)[:1], alone) for m in (2, 3, 5))


def test_an_unpacked_row_matmul_is_the_same_bits_alone_or_in_a_batch():
    """`linear` (unpacked weights: each MoE expert's slice, MLA's up-projection) runs one row as two too: an expert
    that gets one token this step must give it the bits it gives that token among others."""
    import torch

    from cbatch.model import onednn

    torch.manual_seed(0)
    weight, x = torch.randn(96, 64), torch.randn(5, 64)
    alone = onednn.linear(x[:1], weight)
    assert all(torch.equal(onednn.linear(x[:m], weight)[:1], alone) for m in (2, 3, 5))


def test_moe_rows_verify_to_the_same_bits(family_checkpoint, monkeypatch):
    """A tiny Mixtral, an oracle drafter (the plain run's own tokens): tokens and log-probabilities equal bit for
    bit, though the verify steps route other numbers of tokens to each expert than the plain steps."""
    path = family_checkpoint("mixtral")
    prompts = random_prompts(3, 128, seed=1, min_len=3, max_len=20)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    plain = outputs(make_engine(path, max_num_seqs=3, policy="fcfs"), prompts, params)
    monkeypatch.setattr(Speculator, "propose", lambda self, seq, limit, threshold=0.0:
                        plain[seq.seq_id][0][len(seq.output_ids) : len(seq.output_ids) + min(limit, 3)])
    engine = make_engine(path, max_num_seqs=3, policy="fcfs", speculative="ngram")
    assert outputs(engine, prompts, params) == plain
    assert engine.scheduler.stats.accepted_tokens > 0


# ---- the draft sources and the cost model, alone ---------------------------------------------------------------
def test_ngram_index_finds_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    index = NgramIndex(2, 3)
    assert index.propose(tokens, 3) == [7, 5, 1]  # after the latest earlier "1 2 3"
    assert NgramIndex(2, 3).propose([4, 5, 6], 3) == []
    assert copy_from([8, 1, 2, 1, 2], 3, 5) == [1, 2, 1, 2, 1]  # a copy running into the end repeats itself
    tokens += [7]
    assert index.propose(tokens, 2) == [5, 1]  # extended incrementally: "2 3 7" -> 5


def test_suffix_table_walks_the_most_frequent_continuation():
    table = SuffixTable(2, 3, max_contexts=10_000)
    table.add([1, 2, 3, 4, 5])
    table.add([1, 2, 3, 4, 6])
    table.add([9, 2, 3, 8])
    assert table.propose([7, 1, 2, 3], 3) == [4, 5]  # "1 2 3" -> 4; "2 3 4" -> 5 or 6 (tie: the smaller); then none
    assert table.match_length([0, 2, 3]) == 2
    small = SuffixTable(2, 2, max_contexts=3)
    small.add(list(range(10)))
    assert len(small) == 3  # bounded: the oldest contexts dropped


def test_auto_drafts_where_it_pays():
    spec = Speculator("auto", 4, 2, 3, StepCost(fixed_tokens=16))
    assert spec.step_threshold(4) == pytest.approx(0.2)  # the tail: cheap drafts
    assert spec.step_threshold(256) > 0.9  # compute-bound: only near-certain drafts
    # a compute-bound start still measures the job's acceptance: every 8th row it turns down probes
    big = Speculator("auto", 4, 2, 3, StepCost(fixed_tokens=16))
    seqs = [Sequence(seq_id=i, prompt_ids=[5, 6, 7, 5, 6], params=SamplingParams(), output_ids=[7])
            for i in range(16)]
    drafts = [big.propose(seq, 4, big.step_threshold(256)) for seq in seqs]
    assert sum(1 for d in drafts if d) == 2 and [5, 6, 7, 5] in drafts
    cost = StepCost()
    for tokens in (8, 64, 8, 64, 32):
        cost.observe(tokens, 0.010 + 0.001 * tokens)
    assert cost.fixed_tokens == pytest.approx(10.0)


def test_auto_fits_its_step_cost_on_decode_steps_only():
    """Prefill chunks (cheaper per token: no lm_head, no sampling) would tilt the fitted line towards a fixed cost
    decode steps do not pay; only decode steps (verify rows among them) are fitted."""
    from cbatch.engine.step import StepInfo

    spec = Speculator("auto", 4, 2, 3)
    for tokens in (8, 64, 8, 64, 32):  # decode steps: 2 ms a step + 1 ms a token
        spec.observe_step(StepInfo(scheduled_tokens=tokens), 0.002 + 0.001 * tokens)
    assert spec.cost.fixed_tokens == pytest.approx(2.0)
    for tokens in (512, 2048, 1024):  # prefill steps at a third of a sampled token's cost: ignored
        spec.observe_step(StepInfo(scheduled_tokens=tokens, prefill_tokens=tokens - 8), 0.01 + 0.0003 * tokens)
    assert spec.cost.fixed_tokens == pytest.approx(2.0)


def test_auto_stops_drafting_for_a_row_whose_drafts_fail():
    """auto per row: a row whose drafts are rejected sees its acceptance fall and stops drafting; a row whose drafts
    hold drafts all k, even in a full compute-bound batch (near-certain drafts save the step's fixed cost)."""
    spec = Speculator("auto", 4, 2, 3, StepCost(fixed_tokens=16))
    failing, holding = (Sequence(seq_id=i, prompt_ids=[5, 6, 7, 5, 6], params=SamplingParams(), output_ids=[7])
                        for i in range(2))
    for _ in range(64):  # 256 verified tokens: the job's acceptance is measured, no more probes
        spec.verified(holding, 4, 4)
    tail = spec.step_threshold(4)  # 0.2: a few rows left, drafts are cheap
    assert spec.propose(holding, 4, tail) == [5, 6, 7, 5]
    drafted = []
    for _ in range(6):
        draft = spec.propose(failing, 4, tail)
        drafted.append(len(draft))
        if draft:
            spec.verified(failing, len(draft), 0)
    assert drafted[0] == 4 and drafted[-1] == 0 and drafted == sorted(drafted, reverse=True)
    assert spec.propose(holding, 4, tail) == [5, 6, 7, 5]  # one row's failures do not stop another's
    full = spec.step_threshold(256)
    assert spec.propose(holding, 4, full) == [5, 6, 7, 5] and spec.propose(failing, 4, full) == []


@pytest.mark.slow
def test_smollm2_copying_passages(smollm2_dir):
    """The real model repeating given passages: prompt lookup drafts most of each answer, tokens unchanged."""
    from cbatch.tokenizer import encode_messages

    tokenizer = load_tokenizer(smollm2_dir)
    passages = ["The old bridge was rebuilt in the early spring after a long delay, and the river traffic returned.",
                "Seven copper wires were measured twice in one week by a young engineer near the harbour."]
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": f"Repeat exactly, word for word: {text}"}])
               for text in passages]
    params = [SamplingParams(max_tokens=28, logprobs=1), SamplingParams(max_tokens=28, temperature=0.7, seed=1)]
    plain, engine = check_same(smollm2_dir, prompts, params, "ngram", min_accepted=10, max_num_seqs=2)
    assert engine.scheduler.stats.steps < engine.plain_steps


def simulated_steps(mode: str, acceptance: float, rows: int = 4, max_tokens: int = 23, **settings):
    """A simulated job (the engine with a cost-model runner: every row "samples" token 0) of `rows` rows whose
    prompts hold no 0: (its steps, drafted, kept tokens, output lengths)."""
    from cbatch.bench.simulator import CostModel, simulated_engine

    engine = simulated_engine(EngineConfig(speculative=mode, max_num_seqs=rows, **settings), CostModel(), 128, 64,
                              acceptance=acceptance)
    prompts = [[i + 1, 9, 8, 7, 6, 5, 4, 3] for i in range(rows)]
    outputs = run_to_completion(engine, prompts, [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * rows)
    stats = engine.scheduler.stats
    return stats.steps, stats.drafted_tokens, stats.accepted_tokens, [len(o.token_ids) for o in outputs]


def test_simulator_models_acceptance():
    """The simulator keeps each drafted token with the given probability while the ones before it were, with
    draws seeded by row and step. The rows (lockstep) output 0 0 0 ...: a draft of k = 4 from their third token on,
    each step's draft short of max_tokens (23): kept all, 1 + 1 + 1 + 5 + 5 + 5 + 5 = 23 tokens in 7 steps; kept
    none, the plain 23 steps (a rejected draft's place takes token 1, so the rows draft less often)."""
    assert simulated_steps("off", 0.0) == (23, 0, 0, [23] * 4)
    steps, drafted, kept, lengths = simulated_steps("ngram", 0.0)
    assert (steps, kept, lengths) == (23, 0, [23] * 4) and drafted >= 4 * 16
    assert simulated_steps("ngram", 1.0) == (7, 4 * 16, 4 * 16, [23] * 4)
    steps, drafted, kept, lengths = simulated_steps("ngram", 0.6)
    assert 7 < steps < 23 and 0 < kept < drafted and lengths == [23] * 4
    assert simulated_steps("ngram", 0.6) == (steps, drafted, kept, lengths)  # seeded: the same in every run


def test_simulated_auto_fits_the_cost_clock():
    """auto's step cost is fitted to the simulated steps' prices (not this process's wall time): a fixed step cost of
    100 tokens (the line through every step), whatever the machine."""
    from cbatch.bench.simulator import CostModel, simulated_engine

    cost = CostModel(per_step=1.0, per_prefill_token=0.01, per_decode_token=0.01)
    engine = simulated_engine(EngineConfig(speculative="auto"), cost, 128, 64, acceptance=1.0)
    run_to_completion(engine, [[1, 2, 3]] * 2, [SamplingParams(max_tokens=30, ignore_eos=True)] * 2)
    assert engine.scheduler.speculator.cost.fixed_tokens == pytest.approx(100.0)


def test_bench_simulate_takes_an_acceptance(tmp_path):
    from ops_jobs import run_inprocess

    flags = ["bench", "--simulate", "--num-prompts", "8", "--input-len", "8:16", "--output-len", "40", "--policy",
             "fcfs", "--speculative", "ngram", "--report", str(tmp_path / "bench.json")]
    reports = {}
    for acceptance in ("0", "0.8"):
        code, stdout, err = run_inprocess(*flags, "--speculative-acceptance", acceptance)
        assert code == 0, err
        assert "speculative" in stdout and "drafted tokens kept" in stdout
        reports[acceptance] = json.loads((tmp_path / "bench.json").read_text())["runs"][0]
    assert reports["0"]["speculative"]["accepted_tokens"] == 0
    assert reports["0.8"]["speculative"]["accepted_tokens"] > 0
    assert reports["0.8"]["utilization"]["steps"] < reports["0"]["utilization"]["steps"]
    assert reports["0.8"]["settings"]["speculative_acceptance"] == 0.8
    for args, expected in ((flags + ["--speculative-acceptance", "2"], "between 0 and 1"),
                           (flags + ["--speculative", "off", "--speculative-acceptance", "0.5"], "needs --speculative"),
                           ([f for f in flags if f != "--simulate"] + ["--speculative-acceptance", "0.5"],
                            "only with --simulate")):
        code, _, err = run_inprocess(*args)
        assert code == 2 and expected in err and err.count("\n") == 1, err


def test_image_rows_verify_at_their_m_rope_positions(tmp_path, monkeypatch):
    """A Qwen2-VL row past its prompt sits at index + delta (M-RoPE): its verify rows must too, whether or not the
    step's plain rows have images. The drafter is an oracle (the plain run's own next tokens), so every draft holds."""
    from cbatch.io.images import ImageReader
    from cbatch.model.loader import read_checkpoint
    from vision_models import IMAGE_TOKEN, VISION_END, VISION_START, make_vl_checkpoint, png_bytes

    path = make_vl_checkpoint("qwen2_vl", tmp_path / "vl")
    reader = ImageReader(path, read_checkpoint(path).spec.vision)
    image, other = reader.read(png_bytes(56, 84, 1), "a"), reader.read(png_bytes(28, 56, 2), "b")
    requests = [([4, 10, VISION_START, *[IMAGE_TOKEN] * image.num_tokens, VISION_END, 20, 21], [image]),
                ([4, 30, 31, 32, 33, 34, 35], None),  # text only: a plain decode beside the image rows
                ([4, *range(40, 52), VISION_START, *[IMAGE_TOKEN] * other.num_tokens, VISION_END, 60], [other])]
    params = SamplingParams(max_tokens=10, ignore_eos=True)

    def run(**settings):
        engine = make_engine(path, max_model_len=128, max_num_batched_tokens=16, **settings)
        seqs = [engine.add_request(ids, params, images=images) for ids, images in requests]
        while engine.has_unfinished():
            engine.step()
        return [seq.output_ids for seq in seqs], engine

    plain, _ = run()
    monkeypatch.setattr(Speculator, "propose", lambda self, seq, limit, threshold=0.0:
                        plain[seq.seq_id][len(seq.output_ids) : len(seq.output_ids) + min(limit, 3)])
    drafted, engine = run(speculative="ngram")
    assert drafted == plain
    assert engine.scheduler.stats.accepted_tokens == engine.scheduler.stats.drafted_tokens > 0
