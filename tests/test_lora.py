"""LoRA adapters per row (cbatch/lora, docs/lora.md) against HF transformers + PEFT, float32 on CPU.

Two random PEFT adapters per model, made by PEFT itself with a decisive init (`init_lora_weights=False`: B is
not zero): rank 8 on q/v/o/down, rank 16 with rsLoRA and an alpha_pattern on k/gate/up. Their rows, mixed with
base-model rows in one batch under chunked prefill and preemption, must give HF + PEFT's greedy tokens, and the
merged model's; every adapter row must differ from the base model's tokens (so the test fails with the delta
off). Then the limits (--max-loras, unknown adapters, unsupported ones) and the job's side (CLI rows, OpenAI
`model`, report, plan, resume fingerprint)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cbatch.config import SamplingParams
from cbatch.lora.adapter import LoraError, check_adapter
from cbatch.model.spec import parse_spec, read_config
from helpers import generate, make_engine, random_prompts
from ops_jobs import read_jsonl, run_inprocess, write_jsonl
from tiny_models import hf_greedy, hf_model, make_lora_adapter

peft = pytest.importorskip("peft")

ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "b": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "gate_proj", "up_proj"],
              alpha_pattern={"gate_proj": 24}),
}
PROMPTS = random_prompts(5, vocab=380, seed=5, min_len=14, max_len=30)
PROMPTS.append(list(PROMPTS[1]))  # the same prompt as row 1, for the base model: no prefix-cache sharing
ROW_ADAPTERS = [None, "a", "b", "a", "b", None]
MAX_TOKENS = 8
PRESSURE = dict(max_num_batched_tokens=24, block_size=4, num_kv_blocks=22)  # chunked prefill and preemption


@pytest.fixture(scope="module")
def model_case(tiny_checkpoints, family_checkpoint, tmp_path_factory):
    """name -> (checkpoint, {adapter: folder}, HF + PEFT's greedy tokens per row, the merged model's, the base's)."""
    from peft import PeftModel

    cache: dict[str, tuple] = {}

    def get(name: str):
        if name in cache:
            return cache[name]
        checkpoint = family_checkpoint(name) if name.startswith("gemma") else tiny_checkpoints[name]
        root = tmp_path_factory.mktemp(f"lora-{name}")
        folders = {a: make_lora_adapter(checkpoint, root / a, seed, **cfg) for seed, (a, cfg) in enumerate(ADAPTERS.items())}
        base = hf_model(checkpoint)
        base_tokens = [hf_greedy(base, p, MAX_TOKENS) for p in PROMPTS]
        peft_tokens, merged_tokens = list(base_tokens), list(base_tokens)  # base rows: the base model's
        for adapter, folder in folders.items():
            rows = [i for i, a in enumerate(ROW_ADAPTERS) if a == adapter]
            model = PeftModel.from_pretrained(hf_model(checkpoint), folder).eval()
            for i in rows:
                peft_tokens[i] = hf_greedy(model, PROMPTS[i], MAX_TOKENS)
            merged = model.merge_and_unload()
            for i in rows:
                merged_tokens[i] = hf_greedy(merged, PROMPTS[i], MAX_TOKENS)
        cache[name] = (checkpoint, folders, peft_tokens, merged_tokens, base_tokens)
        return cache[name]

    return get


def loras(folders: dict[str, Path]) -> tuple[tuple[str, str], ...]:
    return tuple((name, str(path)) for name, path in folders.items())


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])
def test_adapter_rows_match_peft_and_merged_model_in_one_batch(name, model_case):
    checkpoint, folders, peft_tokens, merged_tokens, base_tokens = model_case(name)
    engine = make_engine(checkpoint, loras=loras(folders), **PRESSURE)
    got = generate(engine, PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, lora=a) for a in ROW_ADAPTERS])
    assert got == peft_tokens
    assert got == merged_tokens
    for tokens, own, adapter in zip(got, base_tokens, ROW_ADAPTERS):
        assert (tokens != own) == (adapter is not None)  # every adapter changes its rows' tokens
    assert engine.scheduler.stats.preemptions > 0
    assert sum(map(len, got)) > 5 * len(PROMPTS)


def test_one_adapter_slot_runs_adapters_in_turn(model_case):
    """--max-loras 1: never two adapters in a step (the slots would refuse), the rows wait their turn, same tokens."""
    checkpoint, folders, peft_tokens, *_ = model_case("llama")
    for grouping in (True, False):
        engine = make_engine(checkpoint, loras=loras(folders), max_loras=1, lora_grouping=grouping)
        got = generate(engine, PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, lora=a) for a in ROW_ADAPTERS])
        assert got == peft_tokens
        assert engine.runner.lora.loads >= 2
        if not grouping:  # rows in longest-first order meet the other adapter while one runs
            assert engine.scheduler.stats.stalled_max_loras > 0


def test_grouping_admits_adapter_by_adapter(model_case):
    """With grouping, each adapter's rows are admitted together: fewer adapter changes between admissions."""
    checkpoint, folders, *_ = model_case("llama")
    prompts = random_prompts(24, vocab=380, seed=9, min_len=4, max_len=20)
    adapters = [None, "a", "b"] * 8
    orders = {}
    for grouping in (True, False):
        engine = make_engine(checkpoint, loras=loras(folders), lora_grouping=grouping, max_num_seqs=4)
        seqs = [engine.add_request(p, SamplingParams(max_tokens=2, lora=a)) for p, a in zip(prompts, adapters)]
        started = []
        while engine.has_unfinished():
            engine.step()
            started += [s for s in engine.scheduler.running if s not in started]
        orders[grouping] = [s.params.lora for s in started]
        assert len(started) == len(seqs)
    changes = {g: sum(x != y for x, y in zip(o, o[1:])) for g, o in orders.items()}
    assert changes[True] == 2 and changes[False] > 2


def test_speculative_decoding_drafts_the_base_rows_of_an_adapter_job(model_case, monkeypatch):
    """--speculative with adapters: base-model rows draft and verify (their verify rows run on the base model, in
    steps whose other rows carry adapters), adapter rows do not draft; every token as without speculation."""
    from cbatch.engine.speculative import Speculator

    checkpoint, folders, *_ = model_case("llama")
    prompts, adapters = PROMPTS * 2, ROW_ADAPTERS * 2  # the copies start once the originals finished (fcfs, 3 slots)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, lora=a) for a in adapters]
    settings = dict(loras=loras(folders), max_num_seqs=3, policy="fcfs")
    plain = generate(make_engine(checkpoint, **settings), prompts, params)
    kept: dict[str | None, int] = {}
    verified = Speculator.verified

    def count(self, seq, drafted, accepted):
        kept[seq.params.lora] = kept.get(seq.params.lora, 0) + accepted
        verified(self, seq, drafted, accepted)

    monkeypatch.setattr(Speculator, "verified", count)
    engine = make_engine(checkpoint, speculative="suffix", **settings)
    assert generate(engine, prompts, params) == plain
    assert list(kept) == [None] and kept[None] > 0  # only base rows verified drafts, and kept some
    assert engine.pool.num_free == engine.pool.num_blocks


def test_unknown_adapter_is_an_error_row(model_case):
    checkpoint, folders, peft_tokens, *_ = model_case("llama")
    engine = make_engine(checkpoint, loras=loras(folders))
    bad = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, lora="nope"))
    assert bad.is_finished and "lora 'nope'" in bad.error and "--lora nope=PATH" in bad.error
    got = generate(engine, PROMPTS[1:3], [SamplingParams(max_tokens=MAX_TOKENS, lora=a) for a in ROW_ADAPTERS[1:3]])
    assert got == peft_tokens[1:3]


def _edit_config(folder: Path, target: Path, **changes) -> Path:
    shutil.copytree(folder, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config.update(changes)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target


def test_unsupported_adapters_refused_by_name(model_case, tmp_path, tiny_checkpoints, family_checkpoint):
    checkpoint, folders, *_ = model_case("llama")
    spec = parse_spec(read_config(checkpoint), {})
    cases = {
        "use_dora": (_edit_config(folders["a"], tmp_path / "dora", use_dora=True), "DoRA"),
        "bias": (_edit_config(folders["a"], tmp_path / "bias", bias="lora_only"), "bias"),
        "saves": (_edit_config(folders["a"], tmp_path / "saves", modules_to_save=["lm_head"]), "lm_head"),
    }
    for name, (folder, what) in cases.items():
        with pytest.raises(LoraError, match=rf"LoRA adapter '{name}': .*{what}"):
            check_adapter(name, folder, spec, 16)
    with pytest.raises(LoraError, match=r"LoRA adapter 'b': .*rank 16, above --max-lora-rank 8; run with --max-lora-rank 16"):
        check_adapter("b", folders["b"], spec, 8)
    embed = make_lora_adapter(checkpoint, tmp_path / "embed", 3, r=4, target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(LoraError, match=r"LoRA adapter 'embed': targets embed_tokens, which cbatch cannot adapt"):
        check_adapter("embed", embed, spec, 16)
    moe = family_checkpoint("qwen3_moe")
    moe_spec = parse_spec(read_config(moe), {})
    attention = make_lora_adapter(moe, tmp_path / "moe-attn", 4, r=4, target_modules=["q_proj", "o_proj"])
    assert check_adapter("attn", attention, moe_spec, 16)  # attention adapters of an MoE model are fine
    with pytest.raises(LoraError, match=r"LoRA adapter 'a': targets the MLP of layers.0, a mixture-of-experts layer"):
        check_adapter("a", folders["a"], moe_spec, 16)
    qwen3_spec = parse_spec(read_config(tiny_checkpoints["qwen3"]), {})
    with pytest.raises(LoraError, match=r"LoRA adapter 'b': layers.0.self_attn.k_proj has shapes .* not this model's"):
        check_adapter("b", folders["b"], qwen3_spec, 16)  # another model's adapter


def test_cli_job_rows_openai_model_report_and_changed_adapter(model_case, tmp_path):
    """`cbatch run` with --lora: a row's `lora`, an OpenAI line's `model` naming an adapter, an unknown adapter (an
    error row), the report's counts per adapter; then a changed adapter file makes the same command refuse,
    naming the adapter; an unsupported adapter stops the job before it starts, in one line."""
    checkpoint, folders, peft_tokens, *_ = model_case("llama")
    adapters = {name: shutil.copytree(path, tmp_path / name) for name, path in folders.items()}
    rows = [{"id": f"r{i}", "prompt_token_ids": p, **({"lora": a} if a else {})}
            for i, (p, a) in enumerate(zip(PROMPTS, ROW_ADAPTERS))]
    rows.append({"id": "unknown", "prompt_token_ids": PROMPTS[0], "lora": "nope"})
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    flags = ["--model", str(checkpoint), "--device", "cpu", "--max-tokens", str(MAX_TOKENS), "--token-ids",
             "--lora", f"a={adapters['a']}", "--lora", f"b={adapters['b']}", "--quiet"]
    code, _, err = run_inprocess("run", str(source), "--out", str(out), "--report", str(report), *flags)
    assert code == 1, err  # one error row
    records = {r["id"]: r for r in read_jsonl(out)}
    assert [records[f"r{i}"]["completion_token_ids"] for i in range(len(PROMPTS))] == peft_tokens
    assert records["unknown"]["finish_reason"] == "error" and "lora 'nope'" in records["unknown"]["error"]
    usage = json.loads(report.read_text())["lora"]
    assert {k: v["rows"] for k, v in usage.items()} == {"a": 2, "b": 2, "base": 2}
    assert usage["a"]["output_tokens"] == len(peft_tokens[1]) + len(peft_tokens[3])

    openai = write_jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": "x", "method": "POST", "url": "/v1/completions",
         "body": {"model": "b", "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS}}])
    code, _, err = run_inprocess("run", str(openai), "--out", str(tmp_path / "batch-out.jsonl"), *flags,
                                 "--report", str(tmp_path / "r2.json"))
    assert code == 0, err
    assert read_jsonl(tmp_path / "batch-out.jsonl")[0]["completion_token_ids"] == peft_tokens[2]
    assert json.loads((tmp_path / "r2.json").read_text())["lora"]["b"]["rows"] == 1

    weights = adapters["b"] / "adapter_model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 0.5
    save_file(tensors, weights)
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *flags)
    assert code == 2 and "LoRA adapter 'b'" in err and "--overwrite" in err, err

    dora = _edit_config(adapters["a"], tmp_path / "dora", use_dora=True)
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "o3.jsonl"), "--model", str(checkpoint),
                                 "--device", "cpu", "--lora", f"d={dora}", "--quiet")
    assert code == 2 and err.count("\n") == 1 and "LoRA adapter 'd'" in err and "merge" in err, err
    assert not (tmp_path / "o3.jsonl").exists()


def test_plan_counts_rows_per_adapter_and_refuses_unknown(model_case, tmp_path):
    checkpoint, folders, *_ = model_case("llama")
    rows = [{"prompt_token_ids": p, **({"lora": a} if a else {})} for p, a in zip(PROMPTS, ROW_ADAPTERS)]
    rows.append({"prompt_token_ids": PROMPTS[0], "lora": "nope"})
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    report = tmp_path / "plan.json"
    code, out, err = run_inprocess("plan", str(source), "--model", str(checkpoint), "--device", "cpu", "--no-search",
                                   "--lora", f"a={folders['a']}", "--lora", f"b={folders['b']}", "--report", str(report))
    assert code == 1, err  # the unknown adapter's row
    plan = json.loads(report.read_text())
    assert {k: v["rows"] for k, v in plan["lora"].items()} == {"a": 2, "b": 2, "base": 2}
    assert [e["index"] for e in plan["errors"]] == [len(PROMPTS)] and "lora 'nope'" in plan["errors"][0]["error"]
    assert "rows per LoRA adapter: a 2, b 2, base 2" in out


def test_lora_flags(tmp_path, model_case):
    from cbatch.config import UserError
    from cbatch.lora.registry import job_adapters

    _, folders, *_ = model_case("llama")
    assert job_adapters(["x=/a", " y = /b "], None) == (("x", "/a"), ("y", "/b"))
    for bad, message in ((["x"], "write NAME=PATH"), (["=p"], "write NAME=PATH"), (["a b=p"], "may hold"),
                         (["x=/a", "x=/b"], "given twice")):
        with pytest.raises(UserError, match=message):
            job_adapters(bad, None)
    shelf = tmp_path / "shelf"
    for name, path in folders.items():
        shutil.copytree(path, shelf / name)
    (shelf / "notes").mkdir()  # not an adapter: left out
    assert job_adapters(["z=/z"], shelf) == (("z", "/z"), ("a", str(shelf / "a")), ("b", str(shelf / "b")))
    with pytest.raises(UserError, match="--lora-dir .*no such folder"):
        job_adapters(None, tmp_path / "missing")


def test_result_cache_keys_rows_by_adapter_files(model_case, tmp_path):
    """A row is copied from --result-cache only under the same adapter name and the same adapter files."""
    checkpoint, folders, peft_tokens, *_ = model_case("llama")
    adapter = shutil.copytree(folders["a"], tmp_path / "a")
    rows = [{"id": f"r{i}", "prompt_token_ids": PROMPTS[i], **({"lora": "a"} if i else {})} for i in range(2)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ["--model", str(checkpoint), "--device", "cpu", "--max-tokens", str(MAX_TOKENS), "--token-ids", "--quiet",
             "--result-cache", str(tmp_path / "cache")]

    def run(name: str, *more: str) -> dict:
        report = tmp_path / f"{name}.json"
        code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / f"{name}.jsonl"), "--report",
                                     str(report), *flags, *more)
        assert code == 0, err
        assert read_jsonl(tmp_path / f"{name}.jsonl")[1]["completion_token_ids"] == peft_tokens[1]
        return json.loads(report.read_text())["requests"]

    assert run("first", "--lora", f"a={adapter}")["cached"] == 0
    assert run("again", "--lora", f"a={adapter}")["cached"] == 2
    other = json.loads((adapter / "adapter_config.json").read_text())
    other["lora_alpha"] = other["lora_alpha"]  # the same values, other bytes: a changed file is another adapter
    (adapter / "adapter_config.json").write_text(json.dumps(other, indent=1))
    assert run("changed", "--lora", f"a={adapter}")["cached"] == 0


def test_partial_run_refuses_to_resume_with_a_changed_adapter(model_case, tmp_path):
    """A job's state (a partial run) records each adapter's file hashes; the same job after an adapter file changed
    is refused at preflight, naming the adapter; with the adapter as it was, it resumes."""
    from cbatch.config import EngineConfig
    from cbatch.run.preflight import JobError, JobOptions, preflight

    checkpoint, folders, *_ = model_case("llama")
    adapters = {name: shutil.copytree(path, tmp_path / name) for name, path in folders.items()}
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": PROMPTS[0], "lora": "b"}])
    engine = EngineConfig(model=str(checkpoint), device="cpu", loras=loras(adapters))
    options = JobOptions(input=source, output=tmp_path / "out.jsonl", engine=engine, defaults=SamplingParams())
    state = preflight(options).state
    state.open(False)
    state.close()  # a partial run: its state folder and manifest, no OUTPUT
    config = adapters["b"] / "adapter_config.json"
    original = config.read_text()
    config.write_text(original.replace("{", "{ ", 1))  # other bytes
    with pytest.raises(JobError, match=r"a partial run for .* used the LoRA adapter 'b' with other files"):
        preflight(options)
    config.write_text(original)
    assert preflight(options) is not None  # resumable again
