"""`--task score` rows and /score lines of lists (vLLM's semantics): one text, or a list of one, against a text or a
list (one to one, one to many), two lists of the same length item by item (many to many). Each pair's score equals the pair row's own (within 1e-6, every
request computing alone), for a cross-encoder and a bi-encoder; the cbatch format's `scores` column and vLLM's
`data` list; other shapes are error rows naming the fields."""
from __future__ import annotations

from pathlib import Path

import pytest

from embed_models import make_classifier, make_st_embedding, random_texts
from ops_jobs import read_jsonl, run_inprocess, write_jsonl


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("score-lists")
    return {"bi": make_st_embedding(root / "bi", "mean", seed=4), "cross": make_classifier(root / "cross", 1, "llama", seed=5)}


def run(src: Path, out: Path, model: Path, *flags: str) -> int:
    # one sequence a step, no prefix cache: each request computes alone, so a pair's score has the same bits
    # wherever it runs (as tests/test_rerank.py)
    code, _, stderr = run_inprocess("run", str(src), "--out", str(out), "--model", str(model), "--task", "score",
                                    "--device", "cpu", "--display", "none", "--quiet", "--max-num-seqs", "1",
                                    "--no-prefix-cache", "--allow-errors", *flags)
    assert code == 0, stderr
    return code


def pair_scores(tmp_path: Path, model: Path, pairs: list[tuple[str, str]]) -> list[float]:
    src = write_jsonl(tmp_path / "pairs.jsonl", [{"text_1": a, "text_2": b} for a, b in pairs])
    run(src, tmp_path / "pairs-out.jsonl", model)
    return [r["score"] for r in read_jsonl(tmp_path / "pairs-out.jsonl")]


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= 1e-6 for g, w in zip(got, want))


@pytest.mark.parametrize("kind", ["cross", "bi"])
def test_list_rows_score_each_pair_as_a_pair_row_does(models, tmp_path, kind):
    query, documents = random_texts(1, seed=40)[0], random_texts(4, seed=41)
    lefts = random_texts(3, seed=42)
    one_to_many = [(query, d) for d in documents]
    many_to_many = list(zip(lefts, documents[:3]))
    reference = pair_scores(tmp_path, models[kind], one_to_many + many_to_many)
    assert len({round(s, 6) for s in reference}) == len(reference)  # distinct: a mixed-up order would show
    rows = [{"id": "1n", "text_1": query, "text_2": documents},
            {"id": "nn", "queries": lefts, "documents": documents[:3]},
            {"id": "one-list", "text_1": [query], "text_2": documents},
            {"id": "one-list-text", "text_1": [query], "text_2": documents[0]},
            {"id": "text-one-list", "text_1": query, "text_2": [documents[0]]},
            {"id": "single", "text_1": query, "text_2": documents[0]},
            {"id": "single1", "text_1": query, "text_2": documents[1]},
            {"id": "repeat", "text_1": query, "text_2": [documents[1], documents[1]]}]
    out = tmp_path / "out.jsonl"
    run(write_jsonl(tmp_path / "in.jsonl", rows), out, models[kind])
    got = {r["id"]: r for r in read_jsonl(out)}
    assert close(got["1n"]["scores"], reference[:4]) and got["1n"]["score"] is None
    assert close(got["nn"]["scores"], reference[4:])
    assert close(got["one-list"]["scores"], reference[:4])
    for name in ("one-list-text", "text-one-list"):  # a list on either side: the row's scores, of one pair
        assert close(got[name]["scores"], reference[:1]) and got[name]["score"] is None, got[name]
    assert close(got["repeat"]["scores"], [reference[1]] * 2)
    assert abs(got["single"]["score"] - reference[0]) <= 1e-6 and got["single"]["scores"] is None
    # a bi-encoder embeds each distinct text once (the repeated pair costs one pair's tokens), a cross-encoder reads
    # each pair
    assert got["repeat"]["prompt_tokens"] == got["single1"]["prompt_tokens"] * (1 if kind == "bi" else 2)


def test_score_lines_of_lists_and_bad_shapes(models, tmp_path):
    query, documents = random_texts(1, seed=50)[0], random_texts(3, seed=51)
    reference = pair_scores(tmp_path, models["cross"], [(query, d) for d in documents])

    def line(custom_id: str, url: str, **body) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}

    lines = [line("v1", "/v1/score", model="scorer", queries=query, documents=documents),
             line("plain", "/score", text_1=query, text_2=documents),
             line("pair", "/score", text_1=query, text_2=documents[0]),
             line("one", "/score", text_1=[query], text_2=documents[1]),
             line("lengths", "/score", text_1=[query, query], text_2=documents),
             line("empty", "/score", text_1=query, text_2=[]),
             line("flipped", "/score", text_1=documents, text_2=query),
             line("blank", "/score", text_1=query, text_2=[documents[0], " "])]
    out = tmp_path / "out.jsonl"
    run(write_jsonl(tmp_path / "lines.jsonl", lines), out, models["cross"], "--output-format", "openai")
    got = {r["custom_id"]: r["response"] for r in read_jsonl(out)}
    for name in ("v1", "plain"):
        body = got[name]["body"]
        assert got[name]["status_code"] == 200 and body["object"] == "list"
        assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(3)]
        assert close([d["score"] for d in body["data"]], reference)
    assert got["v1"]["body"]["model"] == "scorer"
    [item] = got["pair"]["body"]["data"]
    assert item["index"] == 0 and abs(item["score"] - reference[0]) <= 1e-6
    [item] = got["one"]["body"]["data"]
    assert item["index"] == 0 and abs(item["score"] - reference[1]) <= 1e-6
    errors = {k: v["body"]["error"]["message"] for k, v in got.items() if v["status_code"] != 200}
    assert errors == {
        "lengths": "`text_1` has 2 texts and `text_2` 3: give one `text_1` text (scored against each `text_2` text) "
                   "or as many as `text_2` has (scored item by item)",
        "empty": "`text_2` must be a text or a non-empty list of texts, got an empty list",
        "flipped": "`text_1` has 3 texts and `text_2` 1: give one `text_1` text (scored against each `text_2` text) "
                   "or as many as `text_2` has (scored item by item)",
        "blank": "`text_2[1]` is empty"}


def test_score_inputs_pair_up_by_vllms_rules():
    """Every shape vLLM's `LLM.score` and /score take (each side a text or a list; 1:1, 1:N, N:N), and N:1, an
    empty list or a non-text refused naming the field; the library's `LLM.score` takes the same rules."""
    from cbatch.io.pooling_rows import score_pairs
    from cbatch.io.row_fields import RowError

    assert score_pairs("text_1", "q", "text_2", "d") == [("q", "d")]
    assert score_pairs("text_1", ["q"], "text_2", "d") == [("q", "d")]
    assert score_pairs("text_1", "q", "text_2", ["d"]) == [("q", "d")]
    assert score_pairs("text_1", ["q"], "text_2", ["d", "e"]) == [("q", "d"), ("q", "e")]
    assert score_pairs("text_1", "q", "text_2", ("d", "e")) == [("q", "d"), ("q", "e")]
    assert score_pairs("queries", ["a", "b"], "documents", ["d", "e"]) == [("a", "d"), ("b", "e")]
    for lefts, rights, message in (
            (["a", "b"], "d", "`text_1` has 2 texts and `text_2` 1: "),
            (["a", "b"], ["d", "e", "f"], "`text_1` has 2 texts and `text_2` 3: "),
            ([], "d", "`text_1` must be a text or a non-empty list of texts, got an empty list"),
            ("q", 7, "`text_2` must be a text or a non-empty list of texts, got int"),
            ("q", ["d", 7], "`text_2[1]` must be a string, got int")):
        with pytest.raises(RowError) as error:
            score_pairs("text_1", lefts, "text_2", rights)
        assert str(error.value).startswith(message)
