"""Images in prompts (issue 48): tiny random Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints give HF
`generate`'s greedy float32 tokens (one image, several, a chunk ending inside an image's placeholders, rows of mixed
sizes in one batch, a row preempted mid-prefill; Qwen3-VL's deepstack features sliced with the chunk's embeddings); an
image is encoded once per engine; prefix caching shares KV between rows with the same image and never between rows
whose placeholders match but whose images differ."""
from __future__ import annotations

import shutil

import pytest

from cbatch.config import SamplingParams
from helpers import make_engine
from vision_models import (IMAGE_TOKEN, VISION_END, VISION_START, hf_vl_greedy, make_vl_checkpoint, read_test_images,
                           run_requests)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SIZES = [(56, 84), (28, 28), (112, 56), (84, 112)]  # pixels: 6, 1, 8 and 12 placeholder tokens (Qwen3-VL's 16-pixel
# patches: resized to 64 x 96, 32 x 32, 128 x 64, 96 x 128, the same counts)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def vl_model(request, tmp_path_factory):
    path = make_vl_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "model")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def images(vl_model):
    """The preprocessed test images (the model's PIL processor): SIZES, and a second image of SIZES[0]'s size."""
    return read_test_images(vl_model, SIZES)


def prompt(images, words: list[int], tail: int = 3) -> list[int]:
    """A chat-like prompt: words, then each image's placeholder run between vision start/end, then `tail` words."""
    ids = [4, *words]
    for i, image in enumerate(images):
        ids += [VISION_START, *[IMAGE_TOKEN] * image.num_tokens, VISION_END, 40 + i]
    return ids + list(range(100, 100 + tail))


def run(engine, requests):
    return run_requests(engine, requests, GREEDY)


def check_hf(path, requests, outputs):
    for (ids, imgs), ours in zip(requests, outputs):
        assert ours == hf_vl_greedy(path, ids, imgs, GREEDY.max_tokens)


def test_greedy_tokens_match_hf_one_image_several_and_mixed_sizes(vl_model, images):
    requests = [(prompt(images[:1], [10, 11]), images[:1]),
                (prompt(images[:4], [12]), images[:4]),  # several images of mixed sizes in one prompt
                (prompt([images[2], images[1]], [13, 14, 15]), [images[2], images[1]]),
                (prompt([], [16, 17]), None)]  # a text-only row in the same batch
    outputs = run(make_engine(vl_model, max_model_len=256), requests)
    assert len(set(outputs[0])) > 2, "decisive: greedy output is not one repeated token"
    check_hf(vl_model, requests, outputs)
    # the image decides: the same prompt with the other image of the same size gives other tokens
    twin = run(make_engine(vl_model, max_model_len=256), [(requests[0][0], [images[4]])])[0]
    assert twin != outputs[0]


def test_chunks_ending_inside_images_and_preemption_mid_prefill(vl_model, images):
    """A 7-token budget cuts every image's placeholder run across steps; 14 blocks of 4 tokens cannot hold the rows
    at once, so prefills are preempted part-way (recomputed) without encoding an image twice."""
    requests = [(prompt([images[3], images[0]], [20, 21], tail=4), [images[3], images[0]]),
                (prompt([images[2]], [22] * 5), [images[2]]),
                (prompt([images[0], images[3]], [23]), [images[0], images[3]])]
    engine = make_engine(vl_model, max_model_len=128, max_num_batched_tokens=7, num_kv_blocks=14, block_size=4,
                         enable_prefix_cache=False)
    seqs = [engine.add_request(ids, GREEDY, images=imgs) for ids, imgs in requests]
    assert not any(seq.error for seq in seqs), [seq.error for seq in seqs]
    preempted_at: list[tuple[int, int]] = []  # (computed tokens, prompt length) of each preemption
    preempt = engine.scheduler._preempt

    def noting(seq, plan):
        preempted_at.append((seq.num_computed, seq.prompt_len))
        preempt(seq, plan)

    engine.scheduler._preempt = noting
    while engine.has_unfinished():
        engine.step()
    assert any(0 < computed < prompt_len for computed, prompt_len in preempted_at), preempted_at
    check_hf(vl_model, requests, [seq.output_ids for seq in seqs])
    assert engine.runner.images.images_encoded == 3  # images 3, 0, 2: once each, whatever the chunks and preemptions


def test_pixels_go_once_encoded_and_an_evicted_image_is_read_again(vl_model, images):
    """A row's images release their pixels once encoded (counted by `ImageWatch`: the arrays alive while the rows
    still decode). Then the rows above again, preempted mid-prefill (14 blocks) with an encoder cache of one image:
    embeddings a row needs again are gone, so its image is read again from its source (no pixels were kept) and
    encoded again, and the tokens are those of the run without preemption (HF's: the test above)."""
    from vision_models import ImageWatch

    with ImageWatch() as watch:
        fresh = read_test_images(vl_model, SIZES)  # 5 images, read (opened) inside the watch
        requests = [(prompt([fresh[3], fresh[0]], [20, 21], tail=4), [fresh[3], fresh[0]]),
                    (prompt([fresh[2]], [22] * 5), [fresh[2]]),
                    (prompt([fresh[0], fresh[3]], [23]), [fresh[0], fresh[3]])]
        outputs = []
        for num_kv_blocks, cache_tokens in ((200, None), (14, 1)):
            engine = make_engine(vl_model, max_model_len=128, max_num_batched_tokens=7, num_kv_blocks=num_kv_blocks,
                                 block_size=4, enable_prefix_cache=False)
            if cache_tokens is not None:
                engine.runner.images.cache.max_tokens = cache_tokens  # (trim keeps one image)
            seqs = [engine.add_request(ids, GREEDY, images=imgs) for ids, imgs in requests]
            opened, alive_prefilled = watch.opened, None
            while engine.has_unfinished():
                engine.step()
                if alive_prefilled is None and all(seq.num_computed >= seq.prompt_len for seq in seqs):
                    alive_prefilled = watch.alive  # every row past its images, still decoding
            outputs.append([seq.output_ids for seq in seqs])
            assert alive_prefilled == watch.alive == 2  # images 1 and 4 (no row's) hold theirs; 0, 2, 3 none
            encoded, preemptions = engine.runner.images.images_encoded, engine.scheduler.stats.preemptions
            if cache_tokens is None:
                assert (preemptions, encoded, watch.opened, opened) == (0, 3, 5, 5)  # once each, nothing read again
            else:  # more encodings than images (evictions), each reading its image again (the pixels had gone)
                assert preemptions > 0 and encoded > 3 and watch.opened - opened == encoded, (encoded, watch.opened)
    assert outputs[1] == outputs[0]


def test_prefix_cache_shares_an_image_and_never_a_different_one(vl_model, images):
    same_size = [images[0], images[4]]  # equal placeholder runs, different pixels
    question = prompt([same_size[0]], [30, 31, 32, 33, 34, 35], tail=6)
    requests = [(question, [same_size[0]]), (question, [same_size[1]]), (question, [same_size[0]])]
    engine = make_engine(vl_model, max_model_len=128, block_size=4)
    outputs = [run(engine, [request])[0] for request in requests]  # one after another: the cache is warm
    stats = engine.scheduler.stats
    assert outputs[0] == outputs[2] and outputs[1] != outputs[0]
    check_hf(vl_model, requests[:2], outputs[:2])
    # the third row takes the first's blocks (up to its last prompt token); the second only the text before the image
    before_image = question.index(IMAGE_TOKEN) // 4
    full = (len(question) - 1) // 4
    assert stats.prefix_cache_hit_tokens == 4 * (before_image + full)
    assert engine.runner.images.images_encoded == 2


def test_a_prompt_whose_placeholders_do_not_fit_its_images_is_an_error(vl_model, images):
    engine = make_engine(vl_model, max_model_len=128)
    short = prompt([images[0]], [5])[:-4] + [100]  # one placeholder of the run cut off
    seq = engine.add_request(short[:3] + short[4:], GREEDY, images=[images[0]])
    assert seq.error and "placeholder" in seq.error
    seq = engine.add_request(prompt([images[0]], [5]), GREEDY)
    assert seq.error == "the prompt has image or video placeholder tokens but the row gives no images or videos"


def tower_features(path, images):
    """(our model loaded from `path` in float32 on CPU, its tower's features of `images`, transformers' features:
    the embeddings, then Qwen3-VL's deepstack features beside them, and the number of deepstack mergers)."""
    import numpy as np
    import torch

    from cbatch.model.backend.registry import make_backend
    from cbatch.model.loader import load_model, read_checkpoint
    from vision_models import hf_model

    cpu = torch.device("cpu")
    model = load_model(read_checkpoint(path), 64, cpu, torch.float32, make_backend("auto", cpu))
    pixels = torch.from_numpy(np.concatenate([image.patches() for image in images]))
    ours = model.visual(pixels, [image.grid for image in images])
    with torch.no_grad():
        ref = hf_model(path).model.get_image_features(pixels, torch.tensor([image.grid for image in images]))
    # Qwen3-VL's deepstack features: per merger, per-image parts (transformers 5.2x) or one tensor (5.17: the GPU
    # machine's)
    deepstack = getattr(ref, "deepstack_features", None) or []
    whole = lambda parts: parts if isinstance(parts, torch.Tensor) else torch.cat(parts)  # noqa: E731
    ref = torch.cat([whole(ref.pooler_output), *(whole(parts) for parts in deepstack)], dim=1)
    assert ours.shape == ref.shape == (sum(image.num_tokens for image in images), 64 * (1 + len(deepstack)))
    return model, ours, ref, len(deepstack)


def test_vision_tower_matches_hfs_image_features(vl_model, images):
    """Every image of a step in one call (varlen attention; Qwen2.5-VL's windows, edge windows smaller; Qwen3-VL's
    learned positions resampled to each grid) gives transformers' embeddings of each image, and Qwen3-VL's deepstack
    features beside them."""
    import numpy as np
    import torch

    model, ours, ref, deepstack = tower_features(vl_model, images)
    assert deepstack == (2 if "qwen3" in vl_model.parent.name else 0)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()  # float32 rounding (conv vs matmul, batched SDPA)
    # an image's embedding is the same bits whichever images share its step (alone or beside others, any order):
    # a row's tokens must not depend on how the scheduler grouped the images
    first = images[0].num_tokens
    alone = model.visual(torch.from_numpy(images[0].patches()), [images[0].grid])
    last_first = model.visual(torch.from_numpy(np.concatenate([image.patches() for image in images[::-1]])),
                              [image.grid for image in images[::-1]])
    assert torch.equal(alone, ours[:first]) and torch.equal(last_first[-first:], ours[:first])


@pytest.mark.parametrize("vl_model", ["qwen2_5_vl"], indirect=True)
def test_a_gated_tower_whose_activation_is_not_silu_keeps_it(vl_model, images, tmp_path):
    """Qwen2.5-VL's gate/up load packed into one matmul whatever the activation; only SiLU's runs the backend's
    silu_and_mul, another (here tanh GELU) its own function on the gate half: transformers' features either way."""
    path = make_vl_checkpoint("qwen2_5_vl", tmp_path / "gelu", vision={"hidden_act": "gelu_pytorch_tanh"})
    model, ours, ref, _ = tower_features(path, images)
    assert model.visual.vs.activation == "gelu_pytorch_tanh"
    assert model.visual.blocks[0].mlp.gate_up_proj.out_features == 2 * 48  # gate | up
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("vl_model", ["qwen2_5_vl", "qwen3_vl"], indirect=True)  # (Qwen3-VL: deepstack's wider rows)
def test_two_ranks_give_the_tokens_of_one(vl_model, images):
    """-tp 2 over gloo: each rank encodes a share of a step's images (rank 0 sends the worker its share's patches and
    gathers the embeddings), rank 0 broadcasts the step's; the language model is split as for text. Under chunks
    ending inside images and preemption, the tokens are one rank's."""
    from cbatch.model.shard import tensor_parallel_sizes

    requests = [(prompt([images[3], images[0]], [20, 21], tail=4), [images[3], images[0]]),
                (prompt([images[2]], [22] * 5), [images[2]]),
                (prompt([], [16, 17]), None),
                (prompt([images[1], images[3]], [23]), [images[1], images[3]])]
    tight = dict(max_model_len=128, max_num_batched_tokens=9, num_kv_blocks=14, block_size=4)  # an image a step
    roomy = dict(max_model_len=128, max_num_batched_tokens=128)  # every image in the first step: shared
    outputs = {}
    for tp, settings in ((1, tight), (2, tight), (2, roomy)):
        engine = make_engine(vl_model, tensor_parallel_size=tp, **settings)
        try:
            outputs[tp, settings is tight] = run(engine, requests)
            assert (engine.scheduler.stats.preemptions > 0) == (settings is tight)
            assert engine.runner.images.images_encoded == 4
            assert (engine.runner.images.images_on_workers > 0) == (settings is roomy)  # (one image a step: rank 0's)
        finally:
            engine.close()
    assert outputs[2, True] == outputs[1, True] == outputs[2, False]
    assert len({tuple(o) for o in outputs[1, True]}) == len(requests)  # decisive: every row its own tokens
    assert tensor_parallel_sizes(engine.spec, limit=4) == [1, 2, 4]  # what cbatch plan offers agrees


@pytest.mark.parametrize("vl_model", ["qwen2_5_vl"], indirect=True)
def test_every_rank_holds_the_whole_vision_tower(vl_model):
    """Under -tp 2 each rank loads the tower whole (rank 0's weights, bit for bit) and its share of the language
    model: the ranks' parameters past the tower add up to one rank's whole model."""
    import torch

    from cbatch.config import EngineConfig
    from cbatch.engine.resolve import load_rank_model, resolve_model
    from cbatch.parallel.comm import Communicator

    class Rank(Communicator):  # a rank's identity without a group: loading a shard needs no collective
        def __init__(self, rank: int, world: int) -> None:
            self.rank, self.world = rank, world

    config = EngineConfig(model=str(vl_model), device="cpu")
    resolved = resolve_model(config)
    layouts = ((0, 1), (0, 2), (1, 2))  # (rank, world)
    whole, *ranks = (load_rank_model(config, resolved, Rank(r, w), torch.device("cpu")) for r, w in layouts)
    for rank in ranks:
        tower = dict(rank.visual.named_parameters())
        assert tower.keys() == dict(whole.visual.named_parameters()).keys()
        assert all(torch.equal(tower[name], p) for name, p in whole.visual.named_parameters())

    def count(model) -> int:  # parameters past the tower
        return sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.visual.parameters())

    assert count(ranks[0]) + count(ranks[1]) > count(whole) > count(ranks[0])  # (norms and the like are replicated)


def test_images_go_to_ranks_by_their_patches():
    from cbatch.engine.tower_shares import assign_ranks

    assert assign_ranks([100, 400, 300, 100, 50], 2) == [1, 0, 1, 0, 1]  # 400 + 100 against 300 + 100 + 50
    assert assign_ranks([64] * 5, 4) == [0, 1, 2, 3, 0]
    assert assign_ranks([], 3) == [] and assign_ranks([7, 9], 1) == [0, 0]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the flash varlen kernel runs on CUDA")
def test_flash_varlen_segments_match_sdpa_per_length_on_the_gpu():
    """The GPU path's one-launch varlen attention against SDPA per segment length, bf16, on segments of a page's
    shapes (windows of 64 patches, edge windows smaller, a whole image of 1,200): the kit's `vision` part runs it."""
    import numpy as np
    import torch

    from cbatch.model.vision import Segments

    torch.manual_seed(0)
    lengths = [64] * 6 + [32, 16, 48, 1200, 64, 8]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    qkv = torch.randn(int(cu[-1]), 3, 16, 80, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)  # strided, as the tower's packed qkv gives them
    flash = Segments(cu, q.device, q.dtype)
    assert flash.flash is not None, "this torch has no torch.nn.attention.varlen"
    ours = flash.attend(q, k, v, 80**-0.5)
    per_length = Segments(cu, q.device, q.dtype)
    per_length.flash = None
    ref = per_length.attend(q, k, v, 80**-0.5)
    assert flash.flash is not None  # (it did not fall back)
    assert (ours.float() - ref.float()).abs().max() < 2e-2


def test_cpu_kernel_segments_match_sdpa_per_length_and_ignore_their_neighbours():
    """The CPU path's segments through the compiled prefill kernel (every row sees its whole segment) against SDPA
    per segment length, float32, on a page's shapes; and a segment's rows are the same bits encoded alone."""
    import numpy as np
    import torch

    from cbatch.model.vision import Segments

    torch.manual_seed(0)
    lengths = [64, 64, 32, 16, 48, 200, 64, 8]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    q, k, v = torch.randn(int(cu[-1]), 3, 4, 16).unbind(1)  # strided, as the tower's packed qkv gives them
    kernel = Segments(cu, q.device, q.dtype)
    assert kernel.chunks is not None, "the compiled CPU kernels are not available here"
    ours = kernel.attend(q, k, v, 0.25)
    per_length = Segments(cu, q.device, q.dtype)
    per_length.chunks = None
    ref = per_length.attend(q, k, v, 0.25)
    assert ref.abs().mean() > 0.05 and (ours - ref).abs().max() < 1e-5
    first, end = int(cu[5]), int(cu[6])  # the 200-row segment alone
    alone = Segments(np.array([0, end - first]), q.device, q.dtype).attend(q[first:end], k[first:end], v[first:end], 0.25)
    assert torch.equal(alone, ours[first:end])


def test_qwen3_vls_interleaved_mrope_axes_are_transformers():
    """Qwen3-VL turns rotary pair c by axis c % 3 (while that axis has pairs left), Qwen2-VL by sections: the axis of
    each cos | sin column at Qwen3-VL-8B's sections, as transformers' rotary embedding lays them out."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextConfig, Qwen3VLTextRotaryEmbedding

    from cbatch.model.mrope import section_axes

    config = Qwen3VLTextConfig(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                              "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    axis_of = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, 64).clone()  # each axis's "frequencies": its id
    theirs = Qwen3VLTextRotaryEmbedding(config).recomposition_frequencies(axis_of)[0, 0].long()
    ours = section_axes((24, 20, 20), 128, interleaved=True)
    assert ours.tolist() == theirs.tolist()
    assert ours[:6].tolist() == [0, 1, 2, 0, 1, 2] and ours[60:64].tolist() == [0, 0, 0, 0]
    assert section_axes((24, 20, 20), 128)[:64].tolist() == [0] * 24 + [1] * 20 + [2] * 20


@pytest.mark.parametrize("vl_model", ["qwen3_vl_moe"], indirect=True)
def test_qwen3_vl_moe_greedy_tokens_match_hf_with_either_expert_layout(vl_model, images, tmp_path):
    """Qwen3-VL-MoE (Qwen3-VL's tower, a Qwen3-MoE decoder whose router always renormalizes): one image, two, and a
    text-only row in one batch give HF's tokens; its experts read from the hub's [E, in, out] stacks (the fixture's)
    and from transformers 5's [E, out, in] give the same model."""
    import torch
    from safetensors import safe_open

    from cbatch.model.backend.registry import make_backend
    from cbatch.model.loader import load_model, read_checkpoint

    with safe_open(vl_model / "model.safetensors", "pt") as f:  # the hub's layout: [E, hidden, 2 x 24]
        assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape() == [4, 64, 48]
    requests = [(prompt(images[:1], [10, 11]), images[:1]),
                (prompt([images[3], images[0]], [12]), [images[3], images[0]]),
                (prompt([], [16, 17]), None)]
    outputs = run(make_engine(vl_model, max_model_len=256), requests)
    assert len({tuple(o) for o in outputs}) == 3 and len(set(outputs[0])) > 2, "decisive"
    check_hf(vl_model, requests, outputs)

    saved = make_vl_checkpoint("qwen3_vl_moe", tmp_path / "saved", hub_experts=False)
    cpu = torch.device("cpu")
    backend = make_backend("auto", cpu)
    hub, ours = (dict(load_model(read_checkpoint(path), 64, cpu, torch.float32, backend).named_parameters())
                 for path in (vl_model, saved))
    assert hub["layers.0.mlp.experts.w13"].shape == (4, 48, 64)
    assert all(torch.equal(hub[name], ours[name]) for name in hub)


@pytest.mark.parametrize("vl_model", ["qwen3_vl_moe"], indirect=True)
def test_qwen3_vl_moe_fp8_checkpoints_store_each_expert_apart(vl_model, images, tmp_path):
    """Qwen3-VL-MoE's FP8 releases keep each expert's gate/up/down as its own FP8 matrix with block scales
    (`experts.{e}.gate_proj.weight` + `weight_scale_inv`), not the float releases' stacks: dequantized at load on
    the CPU, kept in FP8 with the Triton backend, and HF's tokens on the same dequantized weights either way."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from cbatch.model.quant import FP8_DTYPE
    from fp8_models import fp8_config, fp8_tensors

    block = (8, 8)
    quant, dequant = {}, {}
    for name, tensor in load_file(str(vl_model / "model.safetensors")).items():
        quant[name] = dequant[name] = tensor
        if not (name.startswith("model.language_model.layers.") and name.endswith(("proj", "proj.weight"))):
            continue
        if name.endswith("proj.weight"):  # attention: one matrix
            stored, dequant[name] = fp8_tensors(name, tensor, block, False)
            quant |= stored
            continue
        del quant[name]  # a stack of experts [E, in, out] (the float release's) -> each expert's [out, in] apart
        base, _, kind = name.rpartition(".")
        parts = {"down_proj": [kind]} if kind == "down_proj" else {"gate_up_proj": ["gate_proj", "up_proj"]}
        restored = []
        for e, matrix in enumerate(tensor.transpose(1, 2)):
            pieces = []
            for leaf, part in zip(parts[kind], matrix.chunk(len(parts[kind]))):
                stored, dequantized = fp8_tensors(f"{base}.{e}.{leaf}.weight", part.contiguous(), block, False)
                quant |= stored
                pieces.append(dequantized)
            restored.append(torch.cat(pieces))
        dequant[name] = torch.stack(restored).transpose(1, 2).contiguous()
    paths = {}
    for kind, state in (("quant", quant), ("dequant", dequant)):
        paths[kind] = tmp_path / kind
        shutil.copytree(vl_model, paths[kind])
        save_file(state, str(paths[kind] / "model.safetensors"))
    config = json.loads((vl_model / "config.json").read_text())
    (paths["quant"] / "config.json").write_text(json.dumps({**config, "quantization_config": fp8_config(list(block))}))
    layers = config["text_config"]["num_hidden_layers"]
    assert sum(name.endswith("experts.3.down_proj.weight_scale_inv") for name in quant) == layers > 1

    requests = [(prompt(images[:1], [10, 11]), images[:1]), (prompt([images[3], images[0]], [12]), [images[3], images[0]])]
    outputs = run(make_engine(paths["quant"], max_model_len=256), requests)
    assert len(set(outputs[0])) > 2, "decisive"
    check_hf(paths["dequant"], requests, outputs)
    engine = make_engine(paths["quant"], max_model_len=256, attention_backend="triton")
    kept = {name for name, param in engine.runner.model.named_parameters() if param.dtype == FP8_DTYPE}
    assert {"layers.0.mlp.experts.w13", "layers.0.mlp.experts.w2", "layers.1.self_attn.qkv_proj.weight"} <= kept
    assert run(engine, requests[:1]) == outputs[:1]
