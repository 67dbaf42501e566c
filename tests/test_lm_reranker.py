"""LM-head rerankers (vLLM's `classifier_from_token`, cbatch/engine/pooling.py `TokenLogitsHead`): a causal LM whose
score of a (query, document) pair is sigmoid(logit(true) - logit(false)) at the last position of text_1 + text_2,
on the prefill-only path. Each score equals HF's, computed directly from `AutoModelForCausalLM`'s last-position
logits (float32, within 1e-5), for --task score and --task rerank, from the flag, from the model's config.json and
from the library's `hf_overrides`; classify reads the named tokens' logits as its labels."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from embed_models import EMBED_BASE, make_tokenizer, random_texts
from ops_jobs import read_jsonl, run_inprocess, write_jsonl

FALSE, TRUE = "w10", "w11"  # the tiny vocabulary's stand-ins for Qwen3-Reranker's "no" and "yes"


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> Path:
    """A tiny random Qwen3ForCausalLM with the word-level tokenizer (no special tokens added to a text)."""
    import transformers

    path = tmp_path_factory.mktemp("lm-reranker") / "model"
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**EMBED_BASE), dtype=torch.float32)
    model.save_pretrained(path)
    make_tokenizer(path, append_eos=False)
    return path


def hf_logits(path: Path, texts: list[str], tokens: list[str]) -> torch.Tensor:
    """HF's last-position logits of `tokens` for each text (one at a time, float32): [N, len(tokens)]."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.convert_tokens_to_ids(tokens)
    with torch.no_grad():
        return torch.stack([model(**tok(t, return_tensors="pt")).logits[0, -1, ids] for t in texts])


def hf_scores(path: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """vLLM's score of an LM-head reranker: sigmoid(logit(true) - logit(false)) of text_1 + text_2."""
    logits = hf_logits(path, [a + b for a, b in pairs], [FALSE, TRUE])
    return [1 / (1 + math.exp(-float(d))) for d in logits[:, 1] - logits[:, 0]]


def queries_and_documents(seed: int, documents: int) -> tuple[str, list[str]]:
    query = random_texts(1, seed=seed)[0] + " "  # (the word tokenizer needs the space the real templates end with)
    return query, random_texts(documents, seed=seed + 1)


def run(*args) -> tuple[int, str]:
    code, _, stderr = run_inprocess("run", *map(str, args), "--device", "cpu", "--display", "none", "--quiet")
    return code, stderr


def test_score_and_rerank_equal_hf_logit_difference(reranker, tmp_path):
    query, documents = queries_and_documents(60, 6)
    reference = hf_scores(reranker, [(query, d) for d in documents])
    assert max(reference) - min(reference) > 0.2 and len({round(s, 4) for s in reference}) == len(reference)  # decisive
    rows = [{"text_1": query, "text_2": d} for d in documents] + [{"queries": query, "documents": documents}]
    src = write_jsonl(tmp_path / "score.jsonl", rows)
    code, stderr = run(src, "--out", tmp_path / "score-out.jsonl", "--model", reranker, "--task", "score",
                       "--classifier-from-token", f"{FALSE},{TRUE}")
    assert code == 0, stderr
    got = read_jsonl(tmp_path / "score-out.jsonl")
    assert [r["score"] for r in got[:-1]] == pytest.approx(reference, abs=1e-5, rel=0)
    assert got[-1]["scores"] == pytest.approx(reference, abs=1e-5, rel=0)

    src = write_jsonl(tmp_path / "rerank.jsonl", [{"query": query, "documents": documents, "top_n": 3}])
    code, stderr = run(src, "--out", tmp_path / "rerank-out.jsonl", "--model", reranker, "--task", "rerank",
                       "--classifier-from-token", f"{FALSE},{TRUE}")
    assert code == 0, stderr
    results = read_jsonl(tmp_path / "rerank-out.jsonl")[0]["results"]
    order = sorted(range(len(documents)), key=lambda i: -reference[i])
    assert [r["index"] for r in results] == order[:3]
    assert [r["relevance_score"] for r in results] == pytest.approx([reference[i] for i in order[:3]], abs=1e-5, rel=0)


def test_tokens_from_the_config_and_from_hf_overrides(reranker, tmp_path):
    """vLLM's spelling in config.json (a *ForSequenceClassification naming the tokens, Qwen3's
    is_original_qwen3_reranker) needs no flag; the library takes the same keys as `hf_overrides`."""
    from cbatch import LLM

    query, documents = queries_and_documents(70, 4)
    reference = hf_scores(reranker, [(query, d) for d in documents])
    routed = tmp_path / "routed"
    shutil.copytree(reranker, routed)
    config = json.loads((routed / "config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=[FALSE, TRUE],
                  is_original_qwen3_reranker=True)
    (routed / "config.json").write_text(json.dumps(config))
    src = write_jsonl(tmp_path / "rerank.jsonl", [{"query": query, "documents": documents}])
    code, stderr = run(src, "--out", tmp_path / "out.jsonl", "--model", routed, "--task", "rerank")
    assert code == 0, stderr
    results = read_jsonl(tmp_path / "out.jsonl")[0]["results"]
    assert {r["index"]: r["relevance_score"] for r in results} == pytest.approx(dict(enumerate(reference)), abs=1e-5)

    llm = LLM(str(reranker), hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                           "classifier_from_token": [FALSE, TRUE], "is_original_qwen3_reranker": True},
              use_tqdm=False, device="cpu")
    one_to_many = llm.score(query, documents)
    assert [o.outputs.score for o in one_to_many] == pytest.approx(reference, abs=1e-5, rel=0)
    many = llm.score([query] * 2, documents[:2])  # N:N, item by item
    assert [o.outputs.score for o in many] == pytest.approx(reference[:2], abs=1e-5, rel=0)
    assert one_to_many[0].prompt_token_ids == llm.get_tokenizer().encode(query + documents[0])


def test_classify_reads_the_named_tokens(reranker, tmp_path):
    texts = random_texts(3, seed=80)
    tokens = ["w3", "w4", "w5"]
    probs = torch.softmax(hf_logits(reranker, texts, tokens), dim=1)
    src = write_jsonl(tmp_path / "in.jsonl", [{"input": t} for t in texts])
    code, stderr = run(src, "--out", tmp_path / "out.jsonl", "--model", reranker, "--task", "classify",
                       "--classifier-from-token", ",".join(tokens))
    assert code == 0, stderr
    got = read_jsonl(tmp_path / "out.jsonl")
    for row, p in zip(got, probs):
        assert row["probs"] == pytest.approx(p.tolist(), abs=1e-5)
        assert row["label"] == tokens[int(p.argmax())]


@pytest.mark.parametrize("flag, message", [
    ("no,w11", "'no' is not a token of this model's vocabulary"),
    ("w1,w2,w3", "needs a head with one output"),
])
def test_bad_classifier_tokens_are_one_line(reranker, tmp_path, flag, message):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text_1": "w1 ", "text_2": "w2"}])
    code, stderr = run(src, "--out", tmp_path / "out.jsonl", "--model", reranker, "--task", "score",
                       "--classifier-from-token", flag)
    assert code == 2 and message in stderr and "Traceback" not in stderr, stderr


def test_refusals_name_the_setting(reranker):
    """A tensor-parallel LM-head reranker, an hf_overrides key cbatch does not honour, and a method vLLM does not
    have are each one UserError naming it."""
    from types import SimpleNamespace

    from cbatch.api.engine_args import library_settings
    from cbatch.config import SamplingParams, UserError
    from cbatch.model.pooling_config import ClassifierTokens
    from cbatch.model.spec import parse_spec, read_config
    from cbatch.tasks import make_task
    from cbatch.tasks.pooled import check_task_flags

    options = SimpleNamespace(task="score", defaults=SamplingParams(), pooling=None, normalize=None, dimensions=None,
                              classifier=ClassifierTokens((FALSE, TRUE)), score_template=None, reasoning_split=True)
    task = make_task(options, parse_spec(read_config(reranker)), reranker)
    assert task.pooling.head.token_ids == (14, 15) and task.pooling.head.method == "from_2_way_softmax"
    check_task_flags(task, options, 1)
    with pytest.raises(UserError, match="runs on one rank; use --tensor-parallel-size 1"):
        check_task_flags(task, options, 2)
    generate = make_task(SimpleNamespace(**{**vars(options), "task": "generate", "tool_call_parser": None,
                                            "effort_budgets": None}), parse_spec(read_config(reranker)), reranker)
    with pytest.raises(UserError, match="--classifier-from-token is for --task score, rerank, classify or reward"):
        check_task_flags(generate, options, 1)
    with pytest.raises(UserError, match="--score-template is for --task score or rerank; leave it out for --task classify"):
        classify = make_task(SimpleNamespace(**{**vars(options), "task": "classify"}), parse_spec(read_config(reranker)), reranker)
        check_task_flags(classify, SimpleNamespace(classifier=options.classifier, score_template="x"), 1)
    with pytest.raises(UserError, match="hf_overrides: cbatch does not override 'rope_theta'"):
        library_settings(str(reranker), {"hf_overrides": {"classifier_from_token": ["no", "yes"], "rope_theta": 1.0}})
    with pytest.raises(UserError, match="method 'softmax'"):
        ClassifierTokens((FALSE, TRUE), "softmax")
    with pytest.raises(UserError, match="takes two tokens"):
        ClassifierTokens((FALSE,), "from_2_way_softmax")


def test_score_template_renders_each_pair(reranker, tmp_path):
    """--score-template (vLLM's score template: roles query and document) renders each pair before it is
    tokenized; the scores are HF's on the rendered texts, for the CLI's score and rerank and the library's score."""
    from cbatch import LLM

    template = ("w20 {{ (messages | selectattr('role', 'eq', 'query') | first).content }} w21 "
                "{{ (messages | selectattr('role', 'eq', 'document') | first).content }} w22")
    (tmp_path / "score.jinja").write_text(template)
    query, documents = random_texts(1, seed=90)[0], random_texts(4, seed=91)
    rendered = [f"w20 {query} w21 {d} w22" for d in documents]
    logits = hf_logits(reranker, rendered, [FALSE, TRUE])
    reference = [1 / (1 + math.exp(-float(d))) for d in logits[:, 1] - logits[:, 0]]
    flags = ("--classifier-from-token", f"{FALSE},{TRUE}", "--score-template", tmp_path / "score.jinja")
    src = write_jsonl(tmp_path / "score.jsonl", [{"queries": query, "documents": documents}])
    code, stderr = run(src, "--out", tmp_path / "score-out.jsonl", "--model", reranker, "--task", "score", *flags)
    assert code == 0, stderr
    assert read_jsonl(tmp_path / "score-out.jsonl")[0]["scores"] == pytest.approx(reference, abs=1e-5, rel=0)
    src = write_jsonl(tmp_path / "rerank.jsonl", [{"query": query, "documents": documents, "top_n": 2}])
    code, stderr = run(src, "--out", tmp_path / "rerank-out.jsonl", "--model", reranker, "--task", "rerank", *flags)
    assert code == 0, stderr
    order = sorted(range(len(documents)), key=lambda i: -reference[i])[:2]
    assert [r["index"] for r in read_jsonl(tmp_path / "rerank-out.jsonl")[0]["results"]] == order
    llm = LLM(str(reranker), hf_overrides={"classifier_from_token": [FALSE, TRUE]}, use_tqdm=False, device="cpu")
    got = llm.score(query, documents, chat_template=template)
    assert [o.outputs.score for o in got] == pytest.approx(reference, abs=1e-5, rel=0)
