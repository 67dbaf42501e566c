"""One output identity (cbatch/run/identity.py) for the resume fingerprint and the result-cache key: an
output-changing engine setting is one EngineConfig field with its metadata, and both follow it."""
from __future__ import annotations

from dataclasses import field, make_dataclass

import pytest
import torch

from cbatch.config import OUTPUT_ALWAYS, OUTPUT_CHANGED, EngineConfig, SamplingParams
from cbatch.engine.resolve import resolve_model
from cbatch.model.backend import backend_name
from cbatch.run.preflight import JobOptions, job_fingerprint
from cbatch.run.result_cache import generation_identity

CPU = torch.device("cpu")


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt_token_ids": [5, 6]}\n')
    return path


def fingerprint(config: EngineConfig, source, tmp_path) -> dict[str, str]:
    options = JobOptions(input=source, output=tmp_path / "out.jsonl", engine=config, defaults=SamplingParams())
    return job_fingerprint(options, resolve_model(config))


def cache_identity(config: EngineConfig) -> dict:
    return generation_identity("m", config, torch.float32, CPU, 64)


@pytest.mark.parametrize("metadata", [OUTPUT_CHANGED, OUTPUT_ALWAYS])
def test_a_new_output_field_enters_the_fingerprint_and_the_cache_key(tiny_checkpoints, source, tmp_path, metadata):
    """A field added to the engine's config with output metadata (here in a subclass, as a new flag would be) changes
    both the resume fingerprint and the cache key when set; a field without it changes neither."""
    Extended = make_dataclass("Extended", [("new_flag", int, field(default=0, metadata=metadata)),
                                           ("speed_knob", int, field(default=0))],
                              bases=(EngineConfig,), frozen=True, slots=True)
    model = str(tiny_checkpoints["llama"])
    base, flagged = Extended(model=model, device="cpu"), Extended(model=model, device="cpu", new_flag=3)
    knob = Extended(model=model, device="cpu", speed_knob=7)
    assert fingerprint(flagged, source, tmp_path) != fingerprint(base, source, tmp_path)
    assert cache_identity(flagged) != cache_identity(base)
    assert fingerprint(knob, source, tmp_path) == fingerprint(base, source, tmp_path)
    assert cache_identity(knob) == cache_identity(base)
    plain = EngineConfig(model=model, device="cpu")
    # CHANGED: the default adds nothing (identities written before the field existed still hold)
    assert (fingerprint(base, source, tmp_path) == fingerprint(plain, source, tmp_path)) == (metadata is OUTPUT_CHANGED)
    assert (cache_identity(base) == cache_identity(plain)) == (metadata is OUTPUT_CHANGED)


def test_both_record_the_settings_as_the_engine_runs_them(tiny_checkpoints, source, tmp_path):
    """`auto` and the backend it resolves to are one identity, in the fingerprint and in the cache key alike (they
    once disagreed: one recorded the backend as given, the other as resolved)."""
    model = str(tiny_checkpoints["llama"])
    resolved = backend_name("auto", CPU)
    auto, named = EngineConfig(model=model, device="cpu"), EngineConfig(model=model, device="cpu", attention_backend=resolved)
    assert fingerprint(auto, source, tmp_path) == fingerprint(named, source, tmp_path)
    assert cache_identity(auto) == cache_identity(named)
    other = "torch" if resolved != "torch" else "cpu"
    changed = EngineConfig(model=model, device="cpu", attention_backend=other)
    if backend_name(other, CPU) != resolved:
        assert fingerprint(changed, source, tmp_path) != fingerprint(auto, source, tmp_path)
        assert cache_identity(changed) != cache_identity(auto)
    # the job's seed: in the fingerprint; the cache keys each row by the seed it samples with instead
    seeded = EngineConfig(model=model, device="cpu", seed=9)
    assert fingerprint(seeded, source, tmp_path) != fingerprint(auto, source, tmp_path)
    assert cache_identity(seeded) == cache_identity(auto)


def test_a_vision_models_processor_files_enter_the_resume_fingerprint(tmp_path, source):
    """An edited preprocessor_config.json changes every image's pixels and tokens: a partial run made before the
    edit must not be resumed with it."""
    import json

    from vision_models import make_vl_checkpoint

    folder = make_vl_checkpoint("qwen2_5_vl", tmp_path / "vl")
    config = EngineConfig(model=str(folder), device="cpu")
    before = fingerprint(config, source, tmp_path)
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    processor["max_pixels"] = processor["max_pixels"] // 2
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    assert fingerprint(config, source, tmp_path)["settings"] != before["settings"]
    assert fingerprint(config, source, tmp_path) == fingerprint(config, source, tmp_path)


@pytest.mark.parametrize("edit", ["chat_template.jinja", "generation_config.json", "tokenizer_config.json"])
def test_the_tokenizer_template_and_generation_files_enter_the_resume_fingerprint(tmp_path, source, edit):
    """An edited chat template renders every chat row's prompt anew, edited end tokens end rows elsewhere: a partial
    run made before such an edit must not be resumed after it (config.json and the weights were all it held)."""
    import json

    from vision_models import make_vl_checkpoint  # (a checkpoint with a tokenizer and a chat template)

    folder = make_vl_checkpoint("qwen2_5_vl", tmp_path / "vl")
    config = EngineConfig(model=str(folder), device="cpu")
    before = fingerprint(config, source, tmp_path)
    path = folder / edit
    if edit == "chat_template.jinja":
        path.write_text(path.read_text().replace("<|im_start|>", "<|im_start|> "))
    else:
        values = json.loads(path.read_text())
        key = "eos_token_id" if edit == "generation_config.json" else "model_max_length"
        values[key] = 7 if edit == "generation_config.json" else 4096
        path.write_text(json.dumps(values))
    assert fingerprint(config, source, tmp_path)["settings"] != before["settings"]
    assert fingerprint(config, source, tmp_path)["input"] == before["input"]
