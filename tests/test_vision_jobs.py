"""Jobs of rows with images (issue 48), through `cbatch run` on a tiny random Qwen2-VL checkpoint: 64 questions about
4 images compute each image's KV once (the prefix cache) and give the tokens of a run without it."""
from __future__ import annotations

import json

import pytest

from ops_jobs import read_jsonl, run_inprocess, write_jsonl
from test_vision_rows import run, vl_model  # noqa: F401 (the tiny Qwen2-VL checkpoint, `cbatch run` on it)
from vision_models import png_bytes


def test_questions_about_shared_images_compute_each_images_kv_once(vl_model, tmp_path):
    """64 rows, 16 different questions about each of 4 images (56 x 56 pixels: 4 image tokens each). A prompt is
    `<|im_start|> user <|vision_start|> [4 image tokens] <|vision_end|> QUESTION <|im_end|> <|im_start|> assistant`
    (12 tokens): with 4-token blocks its first 2 blocks (the image's run ends at the second's end) are shared by the
    16 rows about the same image, so 15 of them take the image's KV from the prefix cache."""
    from cbatch.observe.report import summary_line

    for k in range(4):
        (tmp_path / f"page{k}.png").write_bytes(png_bytes(56, 56, seed=10 + k))
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"w{20 + i}"}],
             "images": [str(tmp_path / f"page{i % 4}.png")]} for i in range(64)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    common = ("--block-size", 4, "--max-model-len", 64)
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "cached.jsonl", *common, "--report", tmp_path / "cached.json") == 0
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "plain.jsonl", *common, "--no-prefix-cache",
               "--report", tmp_path / "plain.json") == 0

    cached, plain = read_jsonl(tmp_path / "cached.jsonl"), read_jsonl(tmp_path / "plain.jsonl")
    assert [r["prompt_tokens"] for r in cached] == [12] * 64
    assert [r["completion"] for r in cached] == [r["completion"] for r in plain]
    assert len({r["completion"] for r in cached}) > 4, "decisive: the questions change the answers"
    report, plain_report = (json.loads((tmp_path / name).read_text()) for name in ("cached.json", "plain.json"))
    images = report["images"]
    assert {k: v for k, v in images.items() if k != "images_per_s"} == {
        "rows": 64, "images": 64, "image_tokens": 256, "encoded": 4, "encoded_tokens": 16,
        "prefix_cache_hit_tokens": 60 * 4}  # image tokens computed: 256 - 240 = 16, each image's 4 once
    assert images["images_per_s"] > 0
    assert report["utilization"]["prefix_cache_saved_tokens"] == 60 * 8
    assert report["utilization"]["computed_prompt_tokens"] == 64 * 12 - 60 * 8
    # without the prefix cache every row computes its image's KV (the vision tower still encodes each image once)
    assert plain_report["images"]["prefix_cache_hit_tokens"] == 0 and plain_report["images"]["encoded"] == 4
    assert "images: 64 (256 tokens), 4 encoded, 240 image tokens from the prefix cache" in summary_line(report)


def test_the_dashboard_shows_a_jobs_images():
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from cbatch.config import EngineConfig
    from cbatch.observe.dashboard import Dashboard
    from cbatch.observe.metrics import JobMetrics

    now = [0.0]
    metrics = JobMetrics(total_rows=64, clock=lambda: now[0])
    metrics.image_usage.update(rows=32, images=32, image_tokens=128, encoded=4, encoded_tokens=16,
                               prefix_cache_hit_tokens=112)
    now[0] = 8.0
    dashboard = Dashboard(metrics, SimpleNamespace(engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=64)),
                          start=False)
    console = Console(record=True, force_terminal=True, width=160, file=io.StringIO())
    console.print(dashboard.render())
    assert "images       32 (128 tokens), 4 encoded, 112 image tokens from the prefix cache, 4.0 images/s" in \
        console.export_text()


def test_images_are_read_as_rows_are_admitted_and_few_are_held(vl_model, tmp_path):
    """A job of file references reads each image when its row is about to enter the engine, never at the start: when
    the k-th image is opened, at least k - cap rows have finished (cap: the executor's rows with images, read ahead
    or in the engine), and the decoded images alive at once never exceed the cap. Counted, not timed: 200 rows here;
    benchmarks/vision_memory.py runs 10,000 (benchmarks/RESULTS.md)."""
    from cbatch.run.executor import PREFETCH_ROWS
    from vision_models import ImageWatch

    rows, max_num_seqs = 200, 4
    for k in range(8):
        (tmp_path / f"p{k}.png").write_bytes(png_bytes(28, 28, seed=k))
    write_jsonl(tmp_path / "in.jsonl", [{"id": str(i), "messages": [{"role": "user", "content": f"w{i % 200}"}],
                                         "images": [str(tmp_path / f"p{i % 8}.png")]} for i in range(rows)])
    with ImageWatch() as watch:
        assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", "--max-tokens", 1,
                   "--max-num-seqs", max_num_seqs) == 0
    cap = PREFETCH_ROWS + max_num_seqs
    assert len(read_jsonl(tmp_path / "out.jsonl")) == rows and watch.done == rows
    assert watch.opened == rows  # each row's image read once
    assert all(done >= k - cap for k, done in enumerate(watch.done_at_open, start=1)), watch.done_at_open
    assert watch.done_at_open[-1] >= rows - cap > 0  # the last image is opened after most rows are done
    assert watch.peak_alive <= cap, watch.peak_alive


def test_plan_counts_image_tokens_from_headers_without_decoding(vl_model, tmp_path, monkeypatch):
    """`cbatch plan` takes each image's size from its header and the processor's resize rule: the grid and tokens
    of a full read (scaled up to min_pixels, down to max_pixels or --image-max-pixels, odd sizes), no pixels."""
    from PIL import Image, ImageFile

    from cbatch.io.images import ImageReader
    from cbatch.model.loader import read_checkpoint

    vision = read_checkpoint(vl_model).spec.vision
    sizes = [(20, 30), (57, 85), (600, 200), (28, 28), (13, 1300), (333, 444)]  # (height, width)
    sources = [png_bytes(h, w, seed=k) for k, (h, w) in enumerate(sizes)]
    # the model's bounds (28 x 28 .. 28 x 28 x 64 pixels), then tighter ones: each image's tokens
    for bounds, tokens in (((None, None), [1, 6, 52, 1, 10, 54]), ((28 * 28 * 4, 28 * 28 * 9), [6, 6, 5, 4, 20, 6])):
        reader = ImageReader(vl_model, vision, *bounds)
        for source, expected in zip(sources, tokens):
            full, counted = reader.read(source, "a"), reader.read(source, "a", decode=False)
            assert (counted.grid, counted.num_tokens, counted.digest) == (full.grid, full.num_tokens, full.digest)
            assert counted.num_tokens == expected and counted.pixels is None

    for k, source in enumerate(sources):
        (tmp_path / f"p{k}.png").write_bytes(source)
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"w{i}"}],
             "images": [str(tmp_path / f"p{i % len(sizes)}.png")], "max_tokens": 2} for i in range(8)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 0
    prompt_tokens = sum(r["prompt_tokens"] for r in read_jsonl(tmp_path / "out.jsonl"))
    decoded = []
    for cls in (Image.Image, ImageFile.ImageFile):  # every way to pixels goes through a `load`
        monkeypatch.setattr(cls, "load", lambda self, load=cls.load: decoded.append(self.size) or load(self))
    code, _, err = run_inprocess("plan", str(tmp_path / "in.jsonl"), "--model", str(vl_model), "--device", "cpu",
                                 "--report", str(tmp_path / "plan.json"), "--no-search")
    assert code == 0, err
    assert json.loads((tmp_path / "plan.json").read_text())["predicted"]["prompt_tokens"] == prompt_tokens
    assert decoded == []
    reader.read(sources[0], "a")  # (a decode is seen)
    assert sizes[0][::-1] in decoded


def test_a_resume_notices_an_image_file_changed_since_the_partial_run(vl_model, tmp_path, monkeypatch):
    """A finished row's record keeps its images' digests; a resume reads the images of the rows it keeps again and
    refuses (exit 2, one line) when one has other bytes or is gone, as it refuses a changed INPUT. Restored, the same
    command resumes and gives the uninterrupted run's OUTPUT."""
    from cbatch.io.images import digest_of
    from ops_jobs import part_records, sigterm_after_rows

    pages = [png_bytes(28, 56, seed=k) for k in range(6)]
    for k, page in enumerate(pages):
        (tmp_path / f"p{k}.png").write_bytes(page)
    write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "messages": [{"role": "user", "content": f"w{i}"}],
                                         "images": [str(tmp_path / f"p{i % 6}.png")]} for i in range(16)])
    flags = ("--max-num-seqs", 2)
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "ref.jsonl", *flags) == 0
    out = tmp_path / "out.jsonl"
    sigterm_after_rows(monkeypatch, 5)
    code, _, err = run_inprocess("run", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", str(vl_model),
                                 "--device", "cpu", "--max-tokens", "6", "--max-num-seqs", "2")
    assert code == 143, err
    monkeypatch.undo()
    records = part_records(out)
    assert 0 < len(records) < 16
    assert all(r["image_digests"] == [digest_of(pages[r["index"] % 6])] for r in records)
    finished = records[0]["index"]

    def resume() -> tuple[int, str]:
        code, _, err = run_inprocess("run", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", str(vl_model),
                                     "--device", "cpu", "--display", "none", "--max-tokens", "6", *map(str, flags))
        return code, err

    (tmp_path / f"p{finished % 6}.png").write_bytes(png_bytes(28, 56, seed=99))  # other bytes, same path
    code, err = resume()
    assert code == 2 and err.count("\n") == 1, err
    first = min(r["index"] for r in records if r["index"] % 6 == finished % 6)
    assert (f"finished row {first} ('r{first}') with `images[0]` ('{tmp_path}/p{finished % 6}.png'), which has "
            "other bytes now; restore the image and run the same command to resume, or pass --overwrite") in err
    (tmp_path / f"p{finished % 6}.png").unlink()
    code, err = resume()
    assert code == 2 and "names a file that does not exist now" in err, err
    assert not out.exists()

    (tmp_path / f"p{finished % 6}.png").write_bytes(pages[finished % 6])
    code, err = resume()
    assert code == 0 and f"resuming: {len(records)} of 16 rows" in err, err
    assert read_jsonl(out) == read_jsonl(tmp_path / "ref.jsonl")


def run_counting_encodes(model, limit: int | None, sizes, text_first: bool):
    """Rows of one image each (`sizes`: (height, width)), greedy, through one engine with --max-image-tokens-per-step
    `limit`: (image tokens encoded in each step, the completions, steps whose admission waited for the budget)."""
    from cbatch.config import SamplingParams
    from cbatch.io.images import ImageReader
    from helpers import make_engine
    from vision_models import IMAGE_TOKEN, VISION_END, VISION_START

    engine = make_engine(model, max_model_len=128, max_image_tokens_per_step=limit)
    reader = ImageReader(model, engine.spec.vision)
    seqs = []
    for k, (h, w) in enumerate(sizes):
        image = reader.read(png_bytes(h, w, k), f"image{k}")
        ids = [*([4, 10 + k, 11, VISION_START] if text_first else []), *[IMAGE_TOKEN] * image.num_tokens, VISION_END, 12 + k]
        seqs.append(engine.add_request(ids, SamplingParams(max_tokens=3, temperature=0.0), images=[image]))
    encoded, images = [], engine.runner.images
    while engine.has_unfinished():
        before = images.image_tokens_encoded
        engine.step()
        encoded.append(images.image_tokens_encoded - before)
    return encoded, [seq.output_ids for seq in seqs], engine.scheduler.stats.stalled_encoder_budget


def test_the_encoder_budget_spreads_images_over_steps(vl_model):
    """--max-image-tokens-per-step 8: images of 12, 6, 1, 6 and 1 tokens (26 in all, one step without a limit). The
    12-token image runs alone in the first step (larger than the budget, it is the step's first); the rows behind it
    compute their text up to their image and wait; then 6 + 1 + 1, then 6. Rows opening with their image wait in the
    queue instead (admission stalls) and are admitted in order, one a step. The tokens are the same."""
    from cbatch.config import ConfigError, EngineConfig

    sizes = [(56, 84), (84, 112), (28, 28), (56, 84), (28, 28)]
    free, free_tokens, _ = run_counting_encodes(vl_model, None, sizes, text_first=True)
    capped, capped_tokens, _ = run_counting_encodes(vl_model, 8, sizes, text_first=True)
    assert free == [26, 0, 0] and capped == [12, 8, 6, 0, 0]
    assert capped_tokens == free_tokens
    free, free_tokens, _ = run_counting_encodes(vl_model, None, [(56, 84)] * 3, text_first=False)
    capped, capped_tokens, stalls = run_counting_encodes(vl_model, 6, [(56, 84)] * 3, text_first=False)
    assert free == [18, 0, 0] and capped == [6, 6, 6, 0, 0] and stalls == 2
    assert capped_tokens == free_tokens
    with pytest.raises(ConfigError, match="max_image_tokens_per_step: must be at least 1"):  # (the CLI: the flag)
        EngineConfig(max_image_tokens_per_step=0)


def test_the_sample_pages_job_runs(vl_model, tmp_path, monkeypatch):
    """sample_data/pages.jsonl (README's OCR example, run from the repository's root) names existing pages: every row
    completes, the receipt read by two rows is encoded once."""
    from ops_jobs import ROOT

    monkeypatch.chdir(ROOT)
    rows = [{**row, "max_tokens": 3} for row in read_jsonl(ROOT / "sample_data" / "pages.jsonl")]  # (a quick run)
    assert run(vl_model, write_jsonl(tmp_path / "pages.jsonl", rows), tmp_path / "out.jsonl",
               "--report", tmp_path / "report.json") == 0
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == ["memo", "receipt", "table", "receipt-total"]
    assert all(r["error"] is None and r["completion_tokens"] > 0 for r in out)
    images = json.loads((tmp_path / "report.json").read_text())["images"]
    assert (images["images"], images["encoded"]) == (4, 3)


@pytest.mark.parametrize("same_image", [False, True])
def test_plans_prefix_cache_keys_image_blocks_by_the_images_bytes(vl_model, tmp_path, same_image):
    """Two rows asking the same question about images of the same size have the same tokens; `cbatch plan`'s
    simulated prefix cache shares their image blocks only when the images' bytes are the same, as the run's does:
    12-token prompts with 4-token blocks, the second row takes the first's 2 leading blocks (8 tokens of 24)."""
    pages = [png_bytes(56, 56, seed=3), png_bytes(56, 56, seed=3 if same_image else 4)]
    for k, page in enumerate(pages):
        (tmp_path / f"p{k}.png").write_bytes(page)
    write_jsonl(tmp_path / "in.jsonl", [{"id": str(k), "messages": [{"role": "user", "content": "w7"}],
                                         "images": [str(tmp_path / f"p{k}.png")]} for k in range(2)])
    common = ("--block-size", 4, "--max-model-len", 64, "--max-num-seqs", 1, "--max-tokens", 2)
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", *common, "--report", tmp_path / "run.json") == 0
    code, _, err = run_inprocess("plan", str(tmp_path / "in.jsonl"), "--model", str(vl_model), "--device", "cpu",
                                 *map(str, common), "--report", str(tmp_path / "plan.json"), "--no-search")
    assert code == 0, err
    planned = json.loads((tmp_path / "plan.json").read_text())["predicted"]["prefix_cache_hit_rate"]
    ran = json.loads((tmp_path / "run.json").read_text())["utilization"]["prefix_cache_hit_rate"]
    assert planned == ran == (8 / 24 if same_image else 0.0)
