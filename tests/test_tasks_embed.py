"""Prefill-only tasks (issue 37): embeddings, cross-encoder and bi-encoder scores, classification and reward heads
against sentence-transformers and HF transformers (float32, CPU), batch and chunking invariance, and the CLI
(`--task`, OpenAI /v1/embeddings lines, bad rows, refusals)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from embed_models import hf_classifier_logits, make_classifier, make_st_embedding, random_texts
from helpers import make_engine
from ops_jobs import read_jsonl, read_output, run_inprocess, write_jsonl

from cbatch.config import SamplingParams, UserError
from cbatch.engine.pooling import ClassifierHead, PoolingParams

LAST = PoolingParams("embed", "last", normalize=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embed")
    return {"st_last": make_st_embedding(root / "st_last", "lasttoken"),
            "st_mean": make_st_embedding(root / "st_mean", "mean", seed=3, normalize=False),
            "cls3": make_classifier(root / "cls3", 3, "qwen3"),
            "reward": make_classifier(root / "reward", 1, "llama", seed=2)}


def pooled(path: Path, texts: list[str], pooling: PoolingParams, pairs: bool = False, **settings) -> torch.Tensor:
    """cbatch's results of `texts` (or pairs), all queued at once: [N, D] float32."""
    settings = {"num_kv_blocks": 400, "block_size": 4, **settings}
    engine = make_engine(path, **settings)
    tok = engine.tokenizer
    seqs = [engine.add_request(tok.encode(*t) if pairs else tok.encode(t), SamplingParams(), seq_id=i, pooling=pooling)
            for i, t in enumerate(texts)]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.output_of(s) for s in seqs]
    assert all(o.finish_reason == "stop" and o.token_ids == [] for o in outs)
    return torch.tensor([o.pooled for o in outs], dtype=torch.float32)


def st_encode(path: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True, batch_size=8).float()


def test_last_token_embeddings_match_sentence_transformers(models):
    texts = random_texts(10, seed=0)
    ours, ref = pooled(models["st_last"], texts, LAST, max_num_batched_tokens=32), st_encode(models["st_last"], texts)
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=1)
    assert cos.min() >= 0.99999
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert (ours @ ours.T).fill_diagonal_(0).abs().max() < 0.99  # decisive: the texts' embeddings differ


def test_mean_pooling_matches_and_chunking_changes_nothing(models):
    texts = random_texts(4, seed=1, min_words=20, max_words=40)
    mean = PoolingParams("embed", "mean")
    whole = pooled(models["st_mean"], texts, mean, max_num_batched_tokens=2048)
    chunked = pooled(models["st_mean"], texts, mean, max_num_batched_tokens=7)  # prompts cut in 7-token chunks
    # the pooled sums are exact across chunks; the hidden states themselves differ in their last bits when a
    # prompt is cut differently (the CPU matmuls pick their kernels by the number of rows)
    torch.testing.assert_close(whole, chunked, atol=1e-5, rtol=1e-5)
    ref = st_encode(models["st_mean"], texts)
    assert torch.nn.functional.cosine_similarity(whole, ref, dim=1).min() >= 0.99999
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)


def test_a_rows_embedding_is_the_same_alone_and_in_a_batch(models):
    """Bit for bit alone and in a full batch; chunked (its prompt cut in 5-token pieces) to float32's last bits."""
    texts = random_texts(12, seed=2)
    batch = pooled(models["st_last"], texts, LAST)
    for i in (0, 5):
        alone = pooled(models["st_last"], [texts[i]], LAST)
        chunked = pooled(models["st_last"], [texts[i]], LAST, max_num_batched_tokens=5)
        assert torch.equal(alone[0], batch[i])
        torch.testing.assert_close(chunked[0], batch[i], atol=1e-5, rtol=1e-5)
        assert torch.dot(chunked[0], batch[i]) >= 0.99999


def test_cls_pooling_dimensions_and_normalize(models):
    texts = random_texts(4, seed=3)
    raw = pooled(models["st_last"], texts, PoolingParams("embed", "cls"), max_num_batched_tokens=6)
    cut = pooled(models["st_last"], texts, PoolingParams("embed", "cls", normalize=True, dimensions=16))
    torch.testing.assert_close(cut, torch.nn.functional.normalize(raw[:, :16], dim=1), atol=1e-6, rtol=1e-6)
    # cls reads the first token: texts opening with the same word share it (causal attention)
    same = pooled(models["st_last"], ["w7 w1 w2", "w7 w9"], PoolingParams("embed", "cls"))
    assert torch.equal(same[0], same[1])


def test_classification_and_reward_heads_match_hf(models):
    texts = random_texts(9, seed=4)
    probs = torch.softmax(pooled(models["cls3"], texts, PoolingParams("classify", head=ClassifierHead()), max_num_batched_tokens=16), 1)
    ref = torch.softmax(hf_classifier_logits(models["cls3"], texts), 1)
    torch.testing.assert_close(probs, ref, atol=1e-5, rtol=0)
    assert len(set(probs.argmax(1).tolist())) > 1  # decisive: not one label for every text
    reward = pooled(models["reward"], texts, PoolingParams("reward", head=ClassifierHead()))
    # a raw logit, against HF's float64 value: HF's own float32 logit is 1.3e-5 from it on these texts, so
    # float32 against float32 would measure two roundings, not ours
    ref = hf_classifier_logits(models["reward"], texts, dtype=torch.float64)
    torch.testing.assert_close(reward, ref, atol=1e-5, rtol=1e-5)
    assert reward.std() > 0.5


def test_cross_encoder_scores_pairs_as_hf(models):
    pairs = list(zip(random_texts(6, seed=5), random_texts(6, seed=6)))
    ours = pooled(models["reward"], pairs, PoolingParams("score", head=ClassifierHead()), pairs=True)
    ref = hf_classifier_logits(models["reward"], pairs)
    torch.testing.assert_close(torch.sigmoid(ours), torch.sigmoid(ref), atol=1e-5, rtol=0)


# ---- the CLI ----------------------------------------------------------------------------------------------
def run(*args) -> tuple[int, str, str]:
    return run_inprocess("run", *map(str, args), "--display", "none")


def test_cli_embed_jsonl_and_parquet(models, tmp_path):
    texts = random_texts(5, seed=7, max_words=20)
    rows = [{"id": f"r{i}", "input": t} for i, t in enumerate(texts)]
    rows += [{"id": "empty", "input": "  "}, {"id": "long", "input": " ".join(["w3"] * 40)}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, stdout, stderr = run(src, "--out", out, "--model", models["st_last"], "--task", "embed", "--max-model-len", "32",
                               "--allow-errors")
    assert code == 0, stderr
    assert "embed:" in stdout and "rows/s" in stdout
    import pyarrow.parquet as pq

    assert str(pq.read_schema(out).field("embedding").type) == "list<element: float>"
    got = read_output(out)
    ref = st_encode(models["st_last"], texts)
    torch.testing.assert_close(torch.tensor([r["embedding"] for r in got[:5]]), ref, atol=1e-5, rtol=1e-5)
    assert got[5]["finish_reason"] == "error" and "empty" in got[5]["error"] and got[5]["embedding"] is None
    assert got[6]["finish_reason"] == "error" and "context is 32" in got[6]["error"]


def run_openai_lines(tmp_path: Path, lines: list[dict], model: Path, task: str) -> list[dict]:
    """The OUTPUT lines of `cbatch run` on OpenAI Batch `lines` with --output-format openai (bad lines as error
    lines: --allow-errors); the run must exit 0."""
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    code, _, stderr = run(src, "--out", out, "--model", model, "--task", task, "--output-format", "openai",
                          "--allow-errors")
    assert code == 0, stderr
    return read_jsonl(out)


def test_cli_openai_embeddings_round_trip(models, tmp_path):
    texts = random_texts(3, seed=8)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "tiny-embed", "input": t, **({"dimensions": 8} if i == 2 else {})}}
             for i, t in enumerate(texts)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": "w1", "foo": 1}})
    got = run_openai_lines(tmp_path, lines, models["st_last"], "embed")
    assert [g["custom_id"] for g in got] == ["c0", "c1", "c2", "bad"]
    ref = st_encode(models["st_last"], texts)
    for i, line in enumerate(got[:3]):
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["object"] == "list" and body["model"] == "tiny-embed"
        vector = torch.tensor(body["data"][0]["embedding"])
        expected = ref[i] if i < 2 else torch.nn.functional.normalize(
            pooled(models["st_last"], [texts[2]], PoolingParams("embed", "last"))[0, :8], dim=0)
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == len(texts[i].split()) + 1
    assert got[3]["response"]["status_code"] == 400 and "body.foo" in got[3]["response"]["body"]["error"]["message"]


def test_cli_score_classify_reward(models, tmp_path):
    pairs = list(zip(random_texts(3, seed=9), random_texts(3, seed=10)))
    src = write_jsonl(tmp_path / "pairs.jsonl", [{"text_1": a, "text_2": b} for a, b in pairs[:2]]
                      + [{"query": pairs[2][0], "document": pairs[2][1]}])
    code, _, stderr = run(src, "--out", tmp_path / "bi.jsonl", "--model", models["st_last"], "--task", "score")
    assert code == 0, stderr
    emb = st_encode(models["st_last"], [t for p in pairs for t in p])
    cos = torch.nn.functional.cosine_similarity(emb[0::2], emb[1::2], dim=1)
    torch.testing.assert_close(torch.tensor([r["score"] for r in read_jsonl(tmp_path / "bi.jsonl")]), cos.float(),
                               atol=1e-5, rtol=0)
    code, _, stderr = run(src, "--out", tmp_path / "cross.jsonl", "--model", models["reward"], "--task", "score")
    assert code == 0, stderr
    ref = torch.sigmoid(hf_classifier_logits(models["reward"], pairs))[:, 0]
    torch.testing.assert_close(torch.tensor([r["score"] for r in read_jsonl(tmp_path / "cross.jsonl")]), ref,
                               atol=1e-5, rtol=0)
    texts = random_texts(4, seed=11)
    src = write_jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in texts])
    code, _, stderr = run(src, "--out", tmp_path / "cls.jsonl", "--model", models["cls3"], "--task", "classify")
    assert code == 0, stderr
    got = read_jsonl(tmp_path / "cls.jsonl")
    ref = torch.softmax(hf_classifier_logits(models["cls3"], texts), 1)
    torch.testing.assert_close(torch.tensor([r["probs"] for r in got]), ref, atol=1e-5, rtol=0)
    assert [r["label"] for r in got] == [f"class_{i}" for i in ref.argmax(1).tolist()]
    code, _, stderr = run(src, "--out", tmp_path / "rm.jsonl", "--model", models["reward"], "--task", "reward")
    assert code == 0, stderr
    ref = hf_classifier_logits(models["reward"], texts)[:, 0]
    # a reward is a raw logit (here ~8): float32 relative rounding, which differs by ISA (AVX2 GEMMs: 2.3e-6 seen)
    torch.testing.assert_close(torch.tensor([r["reward"] for r in read_jsonl(tmp_path / "rm.jsonl")]), ref,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model,task,extra,message", [
    ("cls3", "embed", [], "has no pooling config (sentence-transformers modules.json with a Pooling module); give --pooling last"),
    ("cls3", "generate", [], "has no language-model head; use --task classify, reward or score"),
    ("st_last", "classify", [], "needs a sequence classification head"),
    ("cls3", "reward", [], "this Qwen3ForSequenceClassification has 3 labels, use --task classify"),
    ("st_last", "embed", ["--dimensions", "65"], "--dimensions: between 1 and the model's hidden size 64"),
])
def test_cli_refuses_a_task_the_model_cannot_do(models, tmp_path, model, task, extra, message):
    src = write_jsonl(tmp_path / "in.jsonl", [{"input": "w1 w2", "prompt": "w1 w2"}])
    code, _, stderr = run(src, "--out", tmp_path / "o.jsonl", "--model", models[model], "--task", task, *extra)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_resume_and_result_cache_keep_embeddings(models, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"input": t} for t in random_texts(4, seed=12)])
    cache = tmp_path / "cache"
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (first, second):
        code, stdout, stderr = run(src, "--out", out, "--model", models["st_last"], "--task", "embed",
                                   "--result-cache", cache)
        assert code == 0, stderr
    assert "4 from the result cache" in stdout
    assert [r["embedding"] for r in read_jsonl(first)] == [r["embedding"] for r in read_jsonl(second)]
    # another task setting is another identity: nothing from the cache
    code, stdout, stderr = run(src, "--out", tmp_path / "c.jsonl", "--model", models["st_last"], "--task", "embed",
                               "--dimensions", "8", "--result-cache", cache)
    assert code == 0 and "from the result cache" not in stdout, stderr
    assert all(len(r["embedding"]) == 8 for r in read_jsonl(tmp_path / "c.jsonl"))


def test_plan_predicts_a_prefill_only_job(models, tmp_path):
    texts = random_texts(6, seed=13)
    src = write_jsonl(tmp_path / "in.jsonl", [{"input": t} for t in texts] + [{"input": ""}])
    report = tmp_path / "plan.json"
    code, stdout, stderr = run_inprocess("plan", str(src), "--model", str(models["st_last"]), "--task", "embed",
                                         "--allow-errors", "--no-search", "--report", str(report))
    assert code == 0, stderr
    assert "rows/s" in stdout and "7 rows: 6 would run, 1 error rows" in stdout
    plan = json.loads(report.read_text())
    assert plan["task"] == "embed" and plan["predicted"]["output_tokens"] == 0
    assert plan["predicted"]["prompt_tokens"] == sum(len(t.split()) + 1 for t in texts)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_mean_pooling_survives_preemption(models, preemption):
    """Generation rows growing in a small pool preempt the prefill-only rows admitted after them, mid-prompt: a
    recomputed one starts its sums over, a swapped one keeps them; the vectors are the same as without."""
    texts = random_texts(6, seed=14, min_words=25, max_words=40)
    mean = PoolingParams("embed", "mean")
    reference = pooled(models["st_mean"], texts, mean)
    engine = make_engine(models["st_mean"], num_kv_blocks=40, block_size=4, max_num_batched_tokens=8,
                         preemption=preemption, swap_space_gb=0.01)
    tok = engine.tokenizer
    for i in range(3):  # 3 x (12 + 60) tokens: more than the pool once they have grown
        engine.add_request(tok.encode(random_texts(1, 20 + i, 11, 11)[0]), SamplingParams(max_tokens=60, ignore_eos=True),
                           seq_id=100 + i)
    seqs = [engine.add_request(tok.encode(t), SamplingParams(), seq_id=i, pooling=mean) for i, t in enumerate(texts)]
    while engine.has_unfinished():
        engine.step()
    stats = engine.scheduler.stats
    assert stats.preemptions > 0 and max(s.num_preemptions for s in seqs) > 0
    assert (stats.swap_preemptions > 0) == (preemption == "swap")
    got = torch.tensor([engine.output_of(s).pooled for s in seqs])
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


def test_cli_openai_score_lines(models, tmp_path):
    pairs = list(zip(random_texts(2, seed=15), random_texts(2, seed=16)))
    lines = [{"custom_id": f"s{i}", "method": "POST", "url": "/v1/score", "body": {"model": "ce", "text_1": a, "text_2": b}}
             for i, (a, b) in enumerate(pairs)]
    lines.append({"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "w1"}})
    got = run_openai_lines(tmp_path, lines, models["reward"], "score")
    ref = torch.sigmoid(hf_classifier_logits(models["reward"], pairs))[:, 0]
    scores = [g["response"]["body"]["data"][0]["score"] for g in got[:2]]
    torch.testing.assert_close(torch.tensor(scores), ref, atol=1e-5, rtol=0)
    assert got[0]["response"]["body"]["data"][0]["object"] == "score" and got[0]["response"]["body"]["model"] == "ce"
    assert got[2]["response"]["status_code"] == 400 and "/v1/score" in got[2]["response"]["body"]["error"]["message"]


def test_library_api(models):
    from cbatch import LLM

    texts = random_texts(3, seed=17)
    llm = LLM(model=str(models["st_last"]), device="cpu", use_tqdm=False, num_kv_blocks=200)
    embeddings = [o.outputs.embedding for o in llm.embed(texts)]
    torch.testing.assert_close(torch.tensor(embeddings), st_encode(models["st_last"], texts), atol=1e-5, rtol=1e-5)
    assert len(llm.score(texts[:2], texts[1:])) == 2
    cls = LLM(model=str(models["cls3"]), device="cpu", use_tqdm=False, num_kv_blocks=200).classify(texts)
    ref = torch.softmax(hf_classifier_logits(models["cls3"], texts), 1)
    torch.testing.assert_close(torch.tensor([c.outputs.probs for c in cls]), ref, atol=1e-5, rtol=0)
    with pytest.raises(UserError, match="give --pooling"):
        LLM(model=str(models["cls3"]), device="cpu", use_tqdm=False, num_kv_blocks=200).embed(texts)


def test_policies_and_the_prefix_cache(models):
    """Every admission policy gives the same vectors; last-token pooling takes prefix-cache hits (rows sharing a
    prefix compute it once), mean pooling takes none (it reads every position)."""
    shared = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20"
    texts = [f"{shared} {t}" for t in random_texts(6, seed=18, max_words=10)]
    reference = pooled(models["st_last"], texts, LAST, enable_prefix_cache=False)
    for policy in ("static", "prefix"):
        assert torch.equal(pooled(models["st_last"], texts, LAST, policy=policy, max_num_seqs=3, enable_prefix_cache=False),
                           reference)
    for pooling, hits in ((LAST, True), (PoolingParams("embed", "mean"), False)):
        engine = make_engine(models["st_last"], num_kv_blocks=400, block_size=4)
        seqs = []
        for i, text in enumerate(texts):  # one at a time: each row finds the ones before it cached
            seqs.append(engine.add_request(engine.tokenizer.encode(text), SamplingParams(), seq_id=i, pooling=pooling))
            while engine.has_unfinished():
                engine.step()
        assert (engine.scheduler.stats.prefix_cache_hit_tokens > 0) == hits
        if hits:
            got = torch.tensor([engine.output_of(s).pooled for s in seqs])
            torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma2"])
def test_other_families_classification_heads(tmp_path, arch):
    path = make_classifier(tmp_path / arch, 2, arch, seed=5)
    texts = random_texts(4, seed=19)
    probs = torch.softmax(pooled(path, texts, PoolingParams("classify", head=ClassifierHead())), 1)
    torch.testing.assert_close(probs, torch.softmax(hf_classifier_logits(path, texts), 1), atol=1e-5, rtol=0)


def test_sentence_transformers_configs(tmp_path):
    """Both spellings of the pooling config; a module cbatch does not apply is refused by name."""
    from cbatch.model.errors import UnsupportedModelError
    from cbatch.model.pooling_config import ModelPooling, model_pooling

    def folder(name: str, modules: list[str], pooling: dict) -> Path:
        path = tmp_path / name
        (path / "1_Pooling").mkdir(parents=True)
        entries = [{"idx": i, "name": str(i), "path": "1_Pooling" if kind == "Pooling" else f"{i}_{kind}",
                    "type": f"sentence_transformers.models.{kind}"} for i, kind in enumerate(modules)]
        (path / "modules.json").write_text(json.dumps(entries))
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        return path

    old = folder("old", ["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False})
    assert model_pooling(old) == ModelPooling("mean", normalize=False)
    new = folder("new", ["Transformer", "Pooling", "Normalize"], {"pooling_mode": "cls"})
    assert model_pooling(new) == ModelPooling("cls", normalize=True)
    assert model_pooling(tmp_path) is None  # no modules.json: no config of its own
    with pytest.raises(UnsupportedModelError, match="module Dense is not supported"):
        model_pooling(folder("dense", ["Transformer", "Pooling", "Dense"], {"pooling_mode": "mean"}))
    with pytest.raises(UnsupportedModelError, match="pooling max is not supported"):
        model_pooling(folder("max", ["Transformer", "Pooling"], {"pooling_mode": "max"}))


def test_reward_of_chat_rows(models, tmp_path):
    """A reward model rates a conversation: `messages` rendered with the chat template, no generation prompt."""
    import transformers

    texts = random_texts(6, seed=21)
    chats = [[{"role": "user", "content": texts[i]}, {"role": "assistant", "content": texts[i + 3]}] for i in range(3)]
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in chats] + [{"messages": []}])
    out = tmp_path / "rm.jsonl"
    code, _, stderr = run(src, "--out", out, "--model", models["reward"], "--task", "reward", "--allow-errors")
    assert code == 0, stderr
    got = read_jsonl(out)
    tok = transformers.AutoTokenizer.from_pretrained(models["reward"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(models["reward"], dtype=torch.float32).eval()
    for chat, row in zip(chats, got):
        ids = tok.apply_chat_template(chat, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert row["prompt_tokens"] == len(ids)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert abs(row["reward"] - ref) < 1e-5
    assert got[3]["finish_reason"] == "error" and "messages" in got[3]["error"]
