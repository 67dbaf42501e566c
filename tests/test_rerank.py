"""`--task rerank` (cbatch/tasks/rerank_task.py): a query against its documents, one prefill-only request per pair,
gathered back into one row. Each document's relevance score equals the pairwise `--task score` of (query,
document), for a cross-encoder and a bi-encoder; the order and `top_n` follow the scores; OpenAI /rerank lines get
vLLM's and Cohere's response shape; a bad row is an error row naming the field."""
from __future__ import annotations

from pathlib import Path

import pytest

from embed_models import make_classifier, make_st_embedding, random_texts
from ops_jobs import read_jsonl, run_inprocess, write_jsonl


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rerank")
    return {"bi": make_st_embedding(root / "bi", "mean", seed=4), "cross": make_classifier(root / "cross", 1, "llama", seed=5)}


def run(*args) -> tuple[int, str]:
    # one sequence a step, no prefix cache: every request computes alone and whole, so a pair's score has the same
    # bits wherever it runs (in a shared batch, or after a cached prefix, a float32 GEMM of another shape may round
    # a logit ~1e-5 differently)
    code, _, stderr = run_inprocess("run", *map(str, args), "--device", "cpu", "--display", "none", "--quiet",
                                    "--max-num-seqs", "1", "--no-prefix-cache")
    return code, stderr


def pairwise_scores(tmp_path: Path, model: Path, query: str, documents: list[str]) -> list[float]:
    """--task score of each (query, document) pair: the reference a rerank's scores must equal."""
    src = write_jsonl(tmp_path / "pairs.jsonl", [{"text_1": query, "text_2": d} for d in documents])
    code, stderr = run(src, "--out", tmp_path / "pairs-out.jsonl", "--model", model, "--task", "score")
    assert code == 0, stderr
    return [r["score"] for r in read_jsonl(tmp_path / "pairs-out.jsonl")]


@pytest.mark.parametrize("kind", ["cross", "bi"])
def test_rerank_scores_equal_the_pairwise_scores_in_order(models, tmp_path, kind):
    query, documents = random_texts(1, seed=20)[0], random_texts(7, seed=21)
    reference = pairwise_scores(tmp_path, models[kind], query, documents)
    assert len(set(round(s, 6) for s in reference)) == len(reference)  # decisive: distinct scores, one order
    rows = [{"id": "all", "query": query, "documents": documents},
            {"id": "top3", "query": query, "documents": documents, "top_n": 3, "return_documents": True}]
    src = write_jsonl(tmp_path / "rerank.jsonl", rows)
    code, stderr = run(src, "--out", tmp_path / "out.jsonl", "--model", models[kind], "--task", "rerank")
    assert code == 0, stderr
    got = read_jsonl(tmp_path / "out.jsonl")
    order = sorted(range(len(documents)), key=lambda i: -reference[i])
    everything = got[0]["results"]
    assert [r["index"] for r in everything] == order
    for r in everything:
        assert abs(r["relevance_score"] - reference[r["index"]]) <= 1e-6 and r["document"] is None
    assert [r["index"] for r in got[1]["results"]] == order[:3]
    assert [r["document"] for r in got[1]["results"]] == [documents[i] for i in order[:3]]
    query_tokens = len(query.split()) + 1
    assert got[0]["prompt_tokens"] > query_tokens * len(documents) * (kind == "cross")


def test_rerank_openai_lines_and_bad_rows(models, tmp_path):
    query, documents = random_texts(1, seed=30)[0], random_texts(4, seed=31)
    reference = pairwise_scores(tmp_path, models["cross"], query, documents)
    lines = [{"custom_id": f"a{i}", "method": "POST", "url": url,
              "body": {"model": "reranker", "query": query, "documents": documents, "top_n": 2, "return_documents": True}}
             for i, url in enumerate(("/rerank", "/v1/rerank", "/v2/rerank"))]
    lines += [{"custom_id": "no-docs", "url": "/v1/rerank", "body": {"query": query, "documents": []}},
              {"custom_id": "bad-top", "url": "/v1/rerank", "body": {"query": query, "documents": documents, "top_n": -1}},
              {"custom_id": "odd", "url": "/v1/rerank", "body": {"query": query, "documents": documents, "foo": 1}},
              {"custom_id": "wrong-url", "url": "/v1/score", "body": {"query": query, "documents": documents}}]
    src = write_jsonl(tmp_path / "lines.jsonl", lines)
    out = tmp_path / "out.jsonl"
    code, stderr = run(src, "--out", out, "--model", models["cross"], "--task", "rerank", "--output-format", "openai")
    assert code == 1, stderr  # error rows, the others complete
    got = read_jsonl(out)
    order = sorted(range(len(documents)), key=lambda i: -reference[i])[:2]
    for line in got[:3]:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["model"] == "reranker"
        assert [r["index"] for r in body["results"]] == order
        assert [r["document"] for r in body["results"]] == [{"text": documents[i]} for i in order]
        assert all(abs(r["relevance_score"] - reference[r["index"]]) <= 1e-6 for r in body["results"]), (body["results"], reference)
        assert body["usage"]["total_tokens"] > 0
    messages = [line["response"]["body"]["error"]["message"] for line in got[3:]]
    assert "`documents` must be a non-empty list" in messages[0]
    assert "`top_n` must be a non-negative integer" in messages[1]
    assert "body.foo" in messages[2]
    assert "url: --task rerank takes" in messages[3]


def test_rerank_under_chunking_and_a_tiny_pool_matches(models, tmp_path):
    """Many requests per row, chunked prefills and rows waiting for blocks: the same results."""
    rows = [{"query": q, "documents": random_texts(5, seed=40 + i)} for i, q in enumerate(random_texts(6, seed=39))]
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    code, stderr = run(src, "--out", tmp_path / "a.jsonl", "--model", models["bi"], "--task", "rerank")
    assert code == 0, stderr
    code, _, stderr = run_inprocess("run", str(src), "--out", str(tmp_path / "b.jsonl"), "--model", str(models["bi"]),
                                    "--task", "rerank", "--device", "cpu", "--display", "none", "--quiet",
                                    "--max-num-batched-tokens", "16", "--max-num-seqs", "3", "--num-kv-blocks", "24",
                                    "--block-size", "4")
    assert code == 0, stderr
    a, b = read_jsonl(tmp_path / "a.jsonl"), read_jsonl(tmp_path / "b.jsonl")
    for x, y in zip(a, b):
        assert [r["index"] for r in x["results"]] == [r["index"] for r in y["results"]]
        for r, s in zip(x["results"], y["results"]):
            assert abs(r["relevance_score"] - s["relevance_score"]) <= 1e-5  # (other GEMM shapes: float32 rounding)


@pytest.mark.parametrize("task, model, suffix", [("rerank", "cross", ".parquet"), ("rerank", "bi", ".jsonl"),
                                                 ("embed", "bi", ".parquet")])
def test_retry_errors_runs_a_prefill_only_jobs_error_rows(models, tmp_path, task, model, suffix):
    """--retry-errors on a prefill-only job: the ok rows are kept as written (their list columns read back from
    JSONL or Parquet unchanged), the error row (too long for the first run's --max-model-len) runs again."""
    from ops_jobs import read_output

    short, long = random_texts(1, seed=50, max_words=3)[0], random_texts(1, seed=51, min_words=20)[0]
    rows = ([{"id": "short", "query": short, "documents": [short, "w1 w2"]}, {"id": "long", "query": long, "documents": [long]}]
            if task == "rerank" else [{"id": "short", "input": short}, {"id": "long", "input": long}])
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / f"out{suffix}"
    code, stderr = run(src, "--out", out, "--model", models[model], "--task", task, "--max-model-len", "16")
    first = read_output(out)
    assert code == 1 and first[0]["error"] is None, stderr
    assert first[1]["finish_reason"] == "error" and "the model's context is 16" in first[1]["error"]
    code, stderr = run(src, "--out", out, "--model", models[model], "--task", task, "--retry-errors")
    assert code == 0, stderr
    again = read_output(out)
    assert again[0] == first[0]  # kept as it was
    column = "results" if task == "rerank" else "embedding"
    assert again[1]["finish_reason"] == "stop" and again[1][column]
