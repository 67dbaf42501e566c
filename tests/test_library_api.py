"""The library API in vLLM's shapes (cbatch/api, docs/library.md): vLLM's quickstart and the core calls of its
offline `basic/` examples with only the import changed, the same tokens as `cbatch run` on the same rows, the
prefill-only tasks against HF / sentence-transformers, structured outputs, a LoRARequest against HF + PEFT, and
the engine keywords cbatch refuses."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from cbatch import (LLM, CompletionOutput, GuidedDecodingParams, LoRARequest, RequestOutput, SamplingParams,
                    StructuredOutputsParams, TextPrompt, TokensPrompt)
from cbatch.api.engine_args import library_settings
from cbatch.config import UserError
from embed_models import hf_classifier_logits, make_classifier, make_st_embedding, random_texts
from ops_jobs import read_output, run_inprocess, write_jsonl
from tiny_models import hf_greedy, hf_model

QUICKSTART = ["Hello, my name is", "The president of the United States is", "The capital of France is",
              "The future of AI is"]


@pytest.fixture(scope="module")
def tiny(tiny_chat_model):
    """A tiny random Llama with SmolLM2's tokenizer and chat template, loaded once."""
    return LLM(model=str(tiny_chat_model), device="cpu", use_tqdm=False)


@pytest.mark.slow
def test_vllm_quickstart_and_chat_on_smollm2(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), use_tqdm=False)
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)
    outputs = llm.generate(QUICKSTART, sampling_params)
    assert [o.prompt for o in outputs] == QUICKSTART and len({o.request_id for o in outputs}) == 4
    for output in outputs:
        assert isinstance(output, RequestOutput) and output.finished and len(output.outputs) == 1
        generated = output.outputs[0]
        assert isinstance(generated, CompletionOutput) and generated.text.strip()
        assert generated.text == llm.get_tokenizer().decode(generated.token_ids, skip_special_tokens=True)
        assert generated.finish_reason in ("stop", "length") and 1 <= len(generated.token_ids) <= 8
        assert output.prompt_token_ids == llm.get_tokenizer().encode(output.prompt)
    # chat.py: a system prompt, one conversation, then a batch of several
    conversation = [{"role": "system", "content": "You answer in one short sentence."},
                    {"role": "user", "content": "What is the capital of France?"}]
    other = [{"role": "user", "content": "Name three colors of the rainbow."}]
    one = llm.chat(conversation, SamplingParams(max_tokens=8), use_tqdm=False)
    batch = llm.chat([conversation, other], SamplingParams(max_tokens=8), use_tqdm=True)
    assert "Paris" in one[0].outputs[0].text and one[0].prompt.endswith("<|im_start|>assistant\n")
    assert batch[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert batch[1].outputs[0].text != batch[0].outputs[0].text and "You answer" in batch[0].prompt


def cli_records(model, tmp_path, rows, name: str) -> dict[tuple[str, int], dict]:
    """`cbatch run` on `rows`: (id, sample_index) -> its output record."""
    source, out = write_jsonl(tmp_path / f"{name}.jsonl", rows), tmp_path / f"{name}-out.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), "--model", str(model), "--token-ids", "--quiet")
    assert code == 0, err
    return {(r["id"], r.get("sample_index") or 0): r for r in read_output(out)}


def test_same_tokens_as_the_cli(tiny, tiny_chat_model, tmp_path):
    """Greedy, seeded and job-seeded rows, n > 1 grouped in order, logprobs; text prompts, token ids and chats."""
    rows = [{"id": "a", "prompt": "The capital of France is", "max_tokens": 7},
            {"id": "b", "prompt_token_ids": [9, 812, 77, 4051, 23], "max_tokens": 6},
            {"id": "c", "prompt": "Once upon a time", "n": 3, "temperature": 0.9, "seed": 7, "max_tokens": 6},
            {"id": "d", "prompt": "Write a poem", "temperature": 1.0, "top_k": 50, "max_tokens": 5},
            {"id": "e", "prompt": "Tell me about cats", "logprobs": 2, "max_tokens": 5}]
    cli = cli_records(tiny_chat_model, tmp_path, rows, "gen")
    prompts = [TextPrompt(prompt=r["prompt"]) if "prompt" in r else TokensPrompt(prompt_token_ids=r["prompt_token_ids"])
               for r in rows]
    params = [SamplingParams(**{k: v for k, v in r.items() if k not in ("id", "prompt", "prompt_token_ids")})
              for r in rows]
    outputs = tiny.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == [r.get("prompt") for r in rows]
    assert [len(o.outputs) for o in outputs] == [1, 1, 3, 1, 1]
    for row, output in zip(rows, outputs):
        for sample in output.outputs:
            record = cli[(row["id"], sample.index)]
            assert sample.token_ids == record["completion_token_ids"] and sample.text == record["completion"]
            assert sample.finish_reason == record["finish_reason"]
    samples = [s.token_ids for s in outputs[2].outputs]
    assert len({tuple(s) for s in samples}) == 3  # n samples differ: a test that can fail
    logprobs = outputs[4].outputs[0]
    assert math.isclose(logprobs.cumulative_logprob, sum(cli[("e", 0)]["token_logprobs"]), rel_tol=1e-6)
    for token, position in zip(logprobs.token_ids, logprobs.logprobs):
        assert token in position and sorted(r.rank for r in position.values() if r.rank) == [1, 2]
    assert outputs[0].outputs[0].logprobs is None and outputs[0].outputs[0].cumulative_logprob is None
    again = tiny.generate(prompts, params, use_tqdm=False)  # a second call: the same seeds, the same tokens
    assert [[s.token_ids for s in o.outputs] for o in again] == [[s.token_ids for s in o.outputs] for o in outputs]

    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
             [{"role": "user", "content": "What is two plus two?"}]]
    cli = cli_records(tiny_chat_model, tmp_path, [{"id": str(i), "messages": c, "max_tokens": 6}
                                                  for i, c in enumerate(chats)], "chat")
    answers = tiny.chat(chats, SamplingParams(max_tokens=6), use_tqdm=False)
    assert [a.outputs[0].token_ids for a in answers] == [cli[(str(i), 0)]["completion_token_ids"] for i in range(2)]


def test_stop_reasons_and_prompt_shapes(tiny):
    full = tiny.generate("Stop somewhere here", SamplingParams(max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and full.stop_reason is None
    stop = full.text[len(full.text) // 2:][:3]
    cut = tiny.generate({"prompt": "Stop somewhere here"}, SamplingParams(max_tokens=12, stop=stop), use_tqdm=False)
    assert cut[0].outputs[0].stop_reason == stop and cut[0].outputs[0].text == full.text[: full.text.index(stop)]
    token = full.token_ids[3]
    by_id = tiny.generate("Stop somewhere here", SamplingParams(max_tokens=12, stop_token_ids=[token]),
                          use_tqdm=False)[0].outputs[0]
    assert by_id.stop_reason == token and by_id.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    ids = tiny.get_tokenizer().encode("Stop somewhere here")
    as_ids = tiny.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=12), use_tqdm=False)
    assert as_ids[0].outputs[0].token_ids == full.token_ids and as_ids[0].prompt is None
    with pytest.raises(UserError, match="prompt_token_ids"):
        tiny.generate([5, 6, 7])
    with pytest.raises(UserError, match="multi_modal_data"):
        tiny.generate({"prompt": "x", "multi_modal_data": {"image": None}})
    with pytest.raises(UserError, match="enable_lora"):
        tiny.generate("x", lora_request=LoRARequest("a", 1, "/nowhere"))
    with pytest.raises(TypeError, match="best_of"):
        SamplingParams(best_of=2)


def test_chat_template_options(tiny):
    template = ("{{ greeting }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if tools %}tools: {{ tools | map(attribute='name') | join(',') }}\n{% endif %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    chat = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    params = SamplingParams(max_tokens=3)
    opened = tiny.chat(chat, params, chat_template=template, chat_template_kwargs={"greeting": "G! "},
                       tools=[{"name": "search"}, {"name": "add"}])[0]
    assert opened.prompt == "G! [user] Hi there\ntools: search,add\n[assistant]"
    assert len(opened.outputs[0].token_ids) == 3
    closed = tiny.chat(chat, params, chat_template=template, add_generation_prompt=False)[0]
    assert closed.prompt == "[user] Hi there\n"
    assert closed.prompt_token_ids == tiny.get_tokenizer().encode("[user] Hi there\n", add_special_tokens=False)
    with pytest.raises(UserError, match="may not set add_generation_prompt"):
        tiny.chat(chat, params, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(UserError, match="chat_template_content_format"):
        tiny.chat(chat, params, chat_template_content_format="openai")


def test_structured_outputs(tiny):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    kinds = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{3}"),
             StructuredOutputsParams(choice=["Positive", "Negative"]),
             StructuredOutputsParams(grammar='root ::= "yes" | "no" | "maybe " [0-9]'),
             StructuredOutputsParams(json_object=True)]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=k) for i, k in enumerate(kinds)]
    params[4].logit_bias = {tiny.get_tokenizer().convert_tokens_to_ids("{}"): 30.0}  # any object: the empty one
    params.append(SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["alpha", "beta"])))
    texts = [o.outputs[0].text for o in tiny.generate(["Classify this:"] * len(params), params, use_tqdm=False)]
    assert set(json.loads(texts[0])) == {"color", "ok"} and json.loads(texts[0])["color"] in ("red", "green", "blue")
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", texts[1]) and texts[2] in ("Positive", "Negative")
    assert re.fullmatch(r"yes|no|maybe [0-9]", texts[3]) and json.loads(texts[4]) == {}
    assert texts[5] in ("alpha", "beta")
    with pytest.raises(UserError, match="structured_outputs.grammar"):
        tiny.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= (")))
    with pytest.raises(UserError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"]))


def test_lora_request_matches_hf_peft(tiny_chat_model, tmp_path):
    from peft import PeftModel

    from tiny_models import make_lora_adapter

    adapter = make_lora_adapter(tiny_chat_model, tmp_path / "sql", seed=3, r=8, lora_alpha=16,
                               target_modules=["q_proj", "v_proj", "down_proj"])
    llm = LLM(model=str(tiny_chat_model), device="cpu", use_tqdm=False, enable_lora=True, max_lora_rank=8)
    prompts = ["Write SQL for the users table", "Hello"]
    params = SamplingParams(max_tokens=6)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    sql = LoRARequest("sql-lora", 1, str(adapter))
    tuned = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=sql)]
    peft_model = PeftModel.from_pretrained(hf_model(tiny_chat_model), str(adapter)).eval()
    ids = [llm.get_tokenizer().encode(p) for p in prompts]
    assert tuned == [hf_greedy(peft_model, i, 6) for i in ids] and tuned != base
    mixed = llm.generate(prompts, params, lora_request=[None, sql])  # per prompt
    assert [o.outputs[0].token_ids for o in mixed] == [base[0], tuned[1]]
    with pytest.raises(UserError, match="already the adapter"):
        llm.generate(prompts, params, lora_request=LoRARequest("sql-lora", 2, str(tmp_path)))


@pytest.fixture(scope="module")
def pooling_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("library-pooling")
    return {"embed": make_st_embedding(root / "embed", "lasttoken"), "cls3": make_classifier(root / "cls3", 3),
            "reward": make_classifier(root / "reward", 1, "llama", seed=2)}


def test_embed_classify_score_reward(pooling_models):
    from sentence_transformers import SentenceTransformer

    texts, others = random_texts(3, seed=21), random_texts(3, seed=22)
    llm = LLM(model=str(pooling_models["embed"]), runner="pooling", use_tqdm=False)
    embeds = [o.outputs.embedding for o in llm.embed(texts)]
    st = SentenceTransformer(str(pooling_models["embed"]), device="cpu")
    ref = st.encode(texts + others, convert_to_tensor=True).float()
    torch.testing.assert_close(torch.tensor(embeds), ref[:3], atol=1e-5, rtol=1e-5)
    encoded = llm.encode(texts, pooling_task="embed")
    torch.testing.assert_close(torch.stack([o.outputs.data for o in encoded]), ref[:3], atol=1e-5, rtol=1e-5)
    cosines = [o.outputs.score for o in llm.score(texts, others)]  # a bi-encoder: the cosine of the two
    torch.testing.assert_close(torch.tensor(cosines), torch.nn.functional.cosine_similarity(ref[:3], ref[3:]),
                               atol=1e-5, rtol=1e-5)

    cls = LLM(model=str(pooling_models["cls3"]), task="classify", use_tqdm=False)
    probs = [o.outputs.probs for o in cls.classify(texts)]
    ref_probs = torch.softmax(hf_classifier_logits(pooling_models["cls3"], texts), 1)
    torch.testing.assert_close(torch.tensor(probs), ref_probs, atol=1e-5, rtol=0)
    assert [len(p) for p in probs] == [3, 3, 3] and cls.classify(texts[0])[0].outputs.num_classes == 3

    reward = LLM(model=str(pooling_models["reward"]), runner="pooling", use_tqdm=False)
    logits = hf_classifier_logits(pooling_models["reward"], texts)[:, 0]
    rewards = reward.reward(texts)
    torch.testing.assert_close(torch.cat([o.outputs.data for o in rewards]), logits, atol=1e-5, rtol=0)
    scores = reward.score(texts[0], others)  # score.py: one text against several (a cross-encoder)
    pairs = torch.sigmoid(hf_classifier_logits(pooling_models["reward"], [(texts[0], o) for o in others])[:, 0])
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), pairs, atol=1e-5, rtol=0)


def test_engine_keywords(tiny_chat_model):
    model = str(tiny_chat_model)
    for bad, name in (({"swap_space_bytes": 1}, "swap_space_bytes"), ({"tokenizer_mode": "slow"}, "tokenizer_mode"),
                      ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"), ({"task": "draft"}, "task")):
        with pytest.raises(UserError, match=name) as caught:
            LLM(model=model, **bad)
        assert "\n" not in str(caught.value)
    with pytest.raises(UserError, match="runs no remote code"):
        LLM(model=model, trust_remote_code=True)
    with pytest.raises(UserError, match="this checkpoint is not quantized"):
        LLM(model=model, quantization="awq")
    settings = library_settings(model, dict(
        dtype="half", max_model_len=96, tensor_parallel_size=1, gpu_memory_utilization=0.5, max_num_seqs=3,
        max_num_batched_tokens=40, enable_prefix_caching=False, seed=5, enforce_eager=True, kv_cache_dtype="fp8_e4m3",
        enable_lora=True, max_lora_rank=32, max_loras=2, swap_space=1, task="embedding", trust_remote_code=False,
        num_kv_blocks=50))  # (cbatch's own EngineConfig names still work)
    config = settings.config
    assert (config.dtype, config.max_model_len, config.gpu_memory_utilization) == ("float16", 96, 0.5)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.enable_prefix_cache) == (3, 40, False)
    assert (config.seed, config.enforce_eager, config.kv_cache_dtype, config.swap_space_gb) == (5, True, "fp8", 1)
    assert (config.max_lora_rank, config.max_loras) == (32, 2)
    assert settings.enable_lora and settings.task == "embed" and config.num_kv_blocks == 50
    assert library_settings(model, {"dtype": torch.bfloat16}).config.dtype == "bfloat16"


def test_images_in_chat_and_generate_give_the_clis_tokens(tmp_path):
    """OpenAI image parts in `chat` (a path, a data: URI, vLLM's image_pil) and vLLM's `multi_modal_data` in
    `generate` (PIL images): the tokens `cbatch run` gives the same rows; and the mistakes, one sentence each."""
    import base64

    from PIL import Image

    from vision_models import make_vl_checkpoint, png_bytes

    model = make_vl_checkpoint("qwen2_5_vl", tmp_path / "vl")
    pages = [tmp_path / f"p{i}.png" for i in range(2)]
    for i, (page, (h, w)) in enumerate(zip(pages, [(56, 84), (84, 112)])):
        page.write_bytes(png_bytes(h, w, seed=i))
    data_uri = "data:image/png;base64," + base64.b64encode(pages[1].read_bytes()).decode()
    chats = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(pages[0])}},
                                           {"type": "text", "text": "w1 w2 w3"}]}],
             [{"role": "user", "content": [{"type": "text", "text": "w4"},
                                           {"type": "image_url", "image_url": {"url": data_uri}},
                                           {"type": "image_url", "image_url": {"url": str(pages[0])}},
                                           {"type": "text", "text": "w5"}]}],
             [{"role": "user", "content": "w6 w7"}]]
    placeholder = "<|vision_start|> <|image_pad|> <|vision_end|>"
    texts = [f"w8 {placeholder} w9 w10", f"{placeholder} w11 {placeholder} w12"]
    rows = [{"id": f"c{i}", "messages": c, "max_tokens": 6} for i, c in enumerate(chats)]
    rows += [{"id": "t0", "prompt": texts[0], "images": [str(pages[1])], "max_tokens": 6},
             {"id": "t1", "prompt": texts[1], "images": [str(pages[0]), str(pages[1])], "max_tokens": 6}]
    cli = cli_records(model, tmp_path, rows, "vl")
    llm = LLM(model=str(model), device="cpu", use_tqdm=False)
    params = SamplingParams(max_tokens=6)
    answers = llm.chat(chats, params, use_tqdm=False)
    assert [a.outputs[0].token_ids for a in answers] == [cli[(f"c{i}", 0)]["completion_token_ids"] for i in range(3)]
    images = [Image.open(page) for page in pages]
    generated = llm.generate([TextPrompt(prompt=texts[0], multi_modal_data={"image": images[1]}),
                              {"prompt": texts[1], "multi_modal_data": {"image": images}}], params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in generated] == [cli[(f"t{i}", 0)]["completion_token_ids"] for i in range(2)]
    as_array = llm.generate({"prompt": texts[0], "multi_modal_data": {"image": np.asarray(images[1])}}, params,
                            use_tqdm=False)  # vLLM's uint8 [H, W, 3] image
    assert as_array[0].outputs[0].token_ids == generated[0].outputs[0].token_ids
    with pytest.raises(UserError, match=r"prompt 0: multi_modal_data.image\[0\] as an array must be uint8 .* got "
                                        r"\[56, 84, 3\] of float32"):
        llm.generate({"prompt": texts[0], "multi_modal_data": {"image": np.zeros((56, 84, 3), np.float32)}}, params)
    assert generated[0].prompt == texts[0] and answers[0].prompt.count("<|image_pad|>") == 1  # as given, not expanded
    assert len({tuple(a.outputs[0].token_ids) for a in [*answers, *generated]}) == 5  # decisive: each row its own
    pil_part = [{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]},
                                             {"type": "text", "text": "w1 w2 w3"}]}]
    assert llm.chat(pil_part, params, use_tqdm=False)[0].outputs[0].token_ids == answers[0].outputs[0].token_ids
    # the engine keyword of --image-max-pixels: the 56 x 84 page scaled to 28 x 56, 2 image tokens for 6
    small = LLM(model=str(model), device="cpu", use_tqdm=False, image_max_pixels=28 * 28 * 4)
    assert len(small.chat(chats[:1], params, use_tqdm=False)[0].prompt_token_ids) == \
        len(answers[0].prompt_token_ids) - 4

    with pytest.raises(UserError, match=r"prompt 0: the prompt has 2 image placeholder\(s\) for 1 image\(s\)"):
        llm.generate({"prompt": texts[1], "multi_modal_data": {"image": images[0]}}, params)
    # vLLM's limit_mm_per_prompt: a prompt with more images than it allows is refused by name
    limited = LLM(model=str(model), device="cpu", use_tqdm=False, limit_mm_per_prompt={"image": 1, "video": 0})
    one = limited.generate(TextPrompt(prompt=texts[0], multi_modal_data={"image": images[1]}), params, use_tqdm=False)
    assert one[0].outputs[0].token_ids == generated[0].outputs[0].token_ids
    with pytest.raises(UserError, match=r"prompt 0: the prompt has 2 images, more than the 1 the engine's "
                                        r"limit_mm_per_prompt"):
        limited.generate({"prompt": texts[1], "multi_modal_data": {"image": images}}, params)
    with pytest.raises(UserError, match=r"limit_mm_per_prompt: takes image and video counts .* not 'audio'"):
        LLM(model=str(model), device="cpu", limit_mm_per_prompt={"audio": 1})
    # token ids hold the placeholder once per image, as the text does (vLLM's TokensPrompt with multi_modal_data)
    from cbatch.tokenizer import encode_text

    ids = encode_text(llm.get_tokenizer(), texts[1])
    tokens = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, params, use_tqdm=False)
    assert tokens[0].outputs[0].token_ids == generated[1].outputs[0].token_ids
    assert tokens[0].prompt_token_ids == generated[1].prompt_token_ids != ids  # expanded to the images' runs
    with pytest.raises(UserError, match=r"prompt 0: the prompt has 2 image placeholder\(s\) for 1 image\(s\)"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images[0]}}, params)
    with pytest.raises(UserError, match=r"multi_modal_data.video\[0\] must be a video file .*got PngImageFile"):
        llm.generate({"prompt": texts[0], "multi_modal_data": {"video": images}}, params)
    with pytest.raises(UserError, match="takes images and videos .*not audio"):
        llm.generate({"prompt": texts[0], "multi_modal_data": {"audio": b"RIFF"}}, params)
    missing = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(tmp_path / "no.png")}}]}]
    with pytest.raises(UserError, match=r"conversation 0: `messages\[0\].content\[0\]` .* does not exist"):
        llm.chat(missing, params)
    with pytest.raises(UserError, match="images and videos are for generate and chat"):
        llm.embed({"prompt": texts[0], "multi_modal_data": {"image": images[0]}}, pooling="last")


def test_a_text_model_refuses_images_in_one_sentence(tiny, tmp_path):
    from PIL import Image

    image = Image.new("RGB", (28, 28))
    with pytest.raises(UserError, match=r"prompt 0: `multi_modal_data.image\[0\]` is an image; this \w+ reads no"):
        tiny.generate({"prompt": "x", "multi_modal_data": {"image": image}})
    with pytest.raises(UserError, match=r"conversation 0: `messages\[0\].content\[0\]` is an image; this \w+ reads no"):
        tiny.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}])


def test_a_process_that_imports_the_library_can_fork(tmp_path):
    """Importing the library runs no OpenMP region: a process that forks after `import cbatch` (a user's
    multiprocessing pool) gets children whose first parallel matmul completes (GNU OpenMP's pool does not survive
    a fork: the child hangs in its first region). The child runs with two threads whatever the machine has."""
    import subprocess
    import sys

    script = ("import os, torch\nimport cbatch.api.llm, cbatch.engine.build\nfrom cbatch import LLM\n"
              "torch.set_num_threads(2)\npid = os.fork()\n"
              "if pid == 0:\n    x = torch.randn(512, 512)\n    os._exit(0 if (x @ x).abs().sum() > 0 else 3)\n"
              "_, status = os.waitpid(pid, 0)\nraise SystemExit(os.waitstatus_to_exitcode(status))\n")
    done = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
