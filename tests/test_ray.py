"""`cbatch run --ray` and the Ray Data callable, on one small local Ray instance (2 CPUs) shared by the module.

Every Ray job here is compared with the single-process run of the same rows: same bytes out.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from cbatch.config import EngineConfig, SamplingParams
from cbatch.run.job import run_job
from cbatch.run.preflight import JobOptions
from cbatch.scaleout import normalize_ray_flag
from ops_jobs import ROOT, cbatch, jsonl_records, part_records

ROWS = 26
LONG_ROWS = (4, 17)
LONG_TOKENS = 48  # over 3x the other rows' most (14): very unequal blocks; each token is a step of every run here


@pytest.fixture(scope="module", autouse=True)
def one_thread_local_runs():
    """The local runs here use one CPU thread, as each replica does (two threads on two busy cores made the
    reference run the slowest part of a test); EngineConfig.num_threads sets torch's count process-wide, so the
    count the module found is given back after it."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the module (skipped cleanly where Ray is not installed)."""
    ray = pytest.importorskip("ray")
    # address="local": a new instance of its own, never a cluster `ray start` left running on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def job_input(tmp_path_factory, tiny_checkpoints) -> tuple[Path, Path]:
    """Random token-id rows (greedy and sampled without their own seed, random lengths), one bad line, one bad row,
    and two long rows (ignore_eos, many tokens): blocks of very unequal length."""
    rng = random.Random(1234)
    path = tmp_path_factory.mktemp("rayin") / "in.jsonl"
    lines = []
    for i in range(ROWS):
        row = {"id": f"r{i}", "prompt_token_ids": [rng.randrange(3, 384) for _ in range(rng.randint(2, 40))],
               "max_tokens": rng.randint(1, 14)}
        if i % 3 == 0:
            row["temperature"] = 0.9  # seeded from (job seed, row index): must match wherever it runs
        if i in LONG_ROWS:
            row.update(max_tokens=LONG_TOKENS, ignore_eos=True)
        lines.append(json.dumps(row))
    lines.insert(7, "{not json")
    lines.insert(15, json.dumps({"id": "bad", "prompt": 5}))
    path.write_text("\n".join(lines) + "\n")
    return path, tiny_checkpoints["llama"]


def options(inp: Path, out: Path, model: Path, **extra) -> JobOptions:
    return JobOptions(
        input=inp, output=out,
        engine=EngineConfig(model=str(model), device="cpu", max_num_seqs=4, seed=7, num_threads=1),
        defaults=SamplingParams(max_tokens=8), token_ids=True, quiet=True, display="none", **extra,
    )


@pytest.fixture(scope="module")
def local_output(job_input, tmp_path_factory) -> bytes:
    """The single-process run: the reference every Ray run must equal."""
    inp, model = job_input
    out = tmp_path_factory.mktemp("local") / "out.jsonl"
    assert run_job(options(inp, out, model)) == 1  # row errors, as the input has two bad rows
    return out.read_bytes()


def ray_options(**settings):
    from cbatch.scaleout.ray_job import RayOptions

    return RayOptions(**{"replicas": 2, "gpus_per_replica": 0, "block_rows": 3, **settings})


def check_rows(data: bytes) -> list[dict]:
    rows = jsonl_records(data.decode())
    assert len(rows) == ROWS + 2
    assert len({r["id"] for r in rows}) == len(rows)  # every row exactly once
    return rows


def test_two_replicas_match_the_single_process_run(ray_cluster, job_input, local_output, tmp_path):
    """Two replicas give the single-process run's bytes and a report summing theirs; with --out DIR (one run for
    both: a Ray run is seconds of process starts) the driver writes each part the moment the replicas' blocks
    complete its rows. A single --out file under --ray: the tests below."""
    from cbatch.scaleout.ray_job import run_ray_job

    inp, model = job_input
    out, report_path = tmp_path / "res", tmp_path / "report.json"
    code = run_ray_job(options(inp, out, model, report=report_path, part_rows=10, part_format="jsonl"), ray_options())
    assert code == 1  # the same exit code as the local run: two error rows
    names = sorted(p.name for p in out.iterdir())
    assert names == ["_SUCCESS", "_manifest.json", "part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    parts = b"".join((out / n).read_bytes() for n in names[2:])
    assert parts == local_output  # same rows, same order, same tokens (sampled rows included)
    rows = check_rows(parts)
    assert sum(r["finish_reason"] == "error" for r in rows) == 2
    report = json.loads(report_path.read_text())
    assert report["requests"] == {"total": ROWS + 2, "ok": ROWS, "error": 2, "resumed": 0, "cached": 0,
                                  "output_rows": ROWS + 2}
    assert report["tokens"]["output"] == sum(r["completion_tokens"] for r in rows) > ROWS
    replicas = report["replicas"]
    assert len(replicas) == 2 and all(r["status"] == "ok" and r["rows"] > 0 for r in replicas)
    assert sum(r["rows"] for r in replicas) == ROWS + 2  # each row ran once, on one replica
    assert sum(r["output_tokens"] for r in replicas) == report["tokens"]["output"]
    assert all(0 < r["mean_batch_occupancy"] <= 1 and r["busy_seconds"] > 0 for r in replicas)
    steps = sum(r["steps"] for r in replicas)
    assert report["utilization"]["steps"] == steps
    weighted = sum(r["mean_batch_occupancy"] * r["steps"] for r in replicas) / steps
    assert report["utilization"]["mean_batch_occupancy"] == pytest.approx(weighted)
    assert report["throughput"]["output_tokens_per_s"] == pytest.approx(
        report["tokens"]["output"] / report["time"]["wall_seconds"])
    assert report["ray"]["replicas"] == 2 and report["ray"]["retried_blocks"] == 0


def test_a_killed_replica_has_its_rows_retried_exactly_once(ray_cluster, job_input, local_output, tmp_path):
    from cbatch.scaleout.ray_job import run_ray_job

    inp, model = job_input
    out, report_path = tmp_path / "out.jsonl", tmp_path / "report.json"
    killed = [0]

    def no_duplicates(job) -> None:
        job.state.sync()
        records = part_records(job.state.output)
        assert len(records) == len({r["index"] for r in records}) == job.state.num_rows  # never a duplicate

    # fault injection: replica 0's process dies at its engine's 2nd step, in the middle of its first block
    code = run_ray_job(options(inp, out, model, report=report_path), ray_options(crash=(killed[0], 2)),
                       on_block=no_duplicates)
    assert code == 1
    assert out.read_bytes() == local_output  # every row, once, in order, the killed replica's rows included
    check_rows(out.read_bytes())
    report = json.loads(report_path.read_text())
    assert report["requests"]["ok"] + report["requests"]["error"] == ROWS + 2
    assert report["ray"]["retried_blocks"] >= 1 and report["ray"]["replaced_replicas"] == 1
    statuses = {r["replica"]: r["status"] for r in report["replicas"]}
    assert statuses[killed[0]] == "failed" and len(statuses) == 3


def test_a_rerun_after_a_crash_skips_rows_already_written(ray_cluster, job_input, local_output, tmp_path):
    from cbatch.scaleout.ray_job import run_ray_job

    inp, model = job_input
    out, report_path = tmp_path / "out.jsonl", tmp_path / "report.json"
    saved: list[int] = []

    def crash_after_two_blocks(job) -> None:
        if job.state.num_rows >= 6:
            job.state.sync()
            saved.extend(r["index"] for r in part_records(job.state.output))
            raise KeyboardInterrupt  # the driver dies: its part file stays for the re-run

    with pytest.raises(KeyboardInterrupt):
        run_ray_job(options(inp, out, model), ray_options(replicas=1), on_block=crash_after_two_blocks)
    assert not out.exists() and len(saved) >= 6
    assert run_ray_job(options(inp, out, model, report=report_path), ray_options(replicas=1)) == 1
    assert out.read_bytes() == local_output
    report = json.loads(report_path.read_text())
    assert report["requests"]["resumed"] == len(saved)
    assert report["replicas"][0]["rows"] == ROWS + 2 - len(saved)  # only the rows not yet written ran again


def test_kept_columns_and_the_result_cache_work_as_locally(ray_cluster, job_input, tmp_path):
    """--keep-columns and --result-cache under --ray (the job's spec travels to the replicas whole): the same bytes
    as a local run with them, and a second Ray run copies every ok row from the cache the first one filled."""
    from cbatch.scaleout.ray_job import run_ray_job

    inp, model = job_input
    keep = dict(keep_columns="max_tokens,temperature")
    assert run_job(options(inp, tmp_path / "local.jsonl", model, **keep)) == 1
    local = (tmp_path / "local.jsonl").read_bytes()
    assert b'"temperature": 0.9' in local  # decisive: the kept values are there
    cache = tmp_path / "cache"
    assert run_ray_job(options(inp, tmp_path / "a.jsonl", model, result_cache=cache, **keep), ray_options()) == 1
    assert (tmp_path / "a.jsonl").read_bytes() == local
    report_path = tmp_path / "report.json"
    assert run_ray_job(options(inp, tmp_path / "b.jsonl", model, result_cache=cache, report=report_path, **keep),
                       ray_options()) == 1
    assert (tmp_path / "b.jsonl").read_bytes() == local
    report = json.loads(report_path.read_text())
    assert report["requests"]["cached"] == ROWS  # every ok row came from the cache; the two bad rows are errors again


def test_a_deadline_expires_the_rows_left_and_the_same_command_runs_them(ray_cluster, job_input, local_output, tmp_path):
    """--max-wall-time under --ray: once the first block is back the deadline passes (an injected clock; no grace):
    no block is sent any more, the rows not back are `expired`, exit 75; the same command then runs only those and
    OUTPUT equals the single-process run."""
    from cbatch.run.deadline import Deadline
    from cbatch.run.exit_codes import EXIT_EXPIRED
    from cbatch.scaleout.ray_job import run_ray_job

    inp, model = job_input
    out = tmp_path / "out.jsonl"
    passed = {"now": False}

    def first_block_back(job) -> None:
        passed["now"] = True

    deadline = Deadline(at=1.0, grace_s=0.0, flag="--max-wall-time 1s", clock=lambda: 2.0 if passed["now"] else 0.0)
    code = run_ray_job(options(inp, out, model, deadline=deadline), ray_options(replicas=1), on_block=first_block_back)
    assert code == EXIT_EXPIRED
    rows = check_rows(out.read_bytes())
    expired = [r for r in rows if r["finish_reason"] == "expired"]
    assert 0 < len(expired) < ROWS and all("--max-wall-time 1s" in r["error"] for r in expired)
    report_path = tmp_path / "report.json"
    assert run_ray_job(options(inp, out, model, report=report_path), ray_options(replicas=1)) == 1
    assert out.read_bytes() == local_output
    assert json.loads(report_path.read_text())["replicas"][0]["rows"] == len(expired)  # only those ran again


def test_cli_joins_a_running_cluster(ray_cluster, job_input, local_output, tmp_path):
    inp, model = job_input
    out = tmp_path / "out.jsonl"
    address = ray_cluster.get_runtime_context().gcs_address
    proc = cbatch("run", str(inp), "--out", str(out), "--model", str(model), "--device", "cpu", "--max-num-seqs", "4",
                  "--seed", "7", "--max-tokens", "8", "--token-ids", "--display", "none", "--ray", address,
                  "--replicas", "1", "--gpus-per-replica", "0", "--ray-block-rows", "4")
    assert proc.returncode == 1, proc.stderr  # row errors, as locally
    assert out.read_bytes() == local_output
    assert f"cbatch: {ROWS}/{ROWS + 2} rows ok, 2 errors" in proc.stdout and "1 Ray replica(s)" in proc.stdout


def test_pool_larger_than_the_cluster_is_refused(ray_cluster, job_input, tmp_path):
    from cbatch.run.preflight import JobError
    from cbatch.scaleout.ray_job import run_ray_job

    inp, model = job_input
    with pytest.raises(JobError, match=r"--replicas 3 needs 3 CPUs .* has 2"):
        run_ray_job(options(inp, tmp_path / "o.jsonl", model), ray_options(replicas=3))
    with pytest.raises(JobError, match="--gpus-per-replica: must be 1"):
        run_ray_job(options(inp, tmp_path / "o.jsonl", model), ray_options(gpus_per_replica=2))
    assert not list(tmp_path.iterdir())


def test_map_batches_callable(ray_cluster, job_input, local_output):
    from cbatch.scaleout.predictor import CbatchPredictor

    inp, model = job_input
    rows = [json.loads(line) for line in inp.read_text().splitlines() if line.startswith("{\"")]
    expected = {r["id"]: r for r in jsonl_records(local_output.decode())}
    greedy = [r for r in rows if "temperature" not in r]  # sampled rows need their own seed outside a job
    ds = ray_cluster.data.from_items(greedy)
    out = ds.map_batches(
        CbatchPredictor, fn_constructor_kwargs={"model": str(model), "device": "cpu", "max_num_seqs": 4,
                                                "sampling": {"max_tokens": 8}, "token_ids": True},
        compute=ray_cluster.data.ActorPoolStrategy(size=1), num_cpus=1, batch_size=5, batch_format="pyarrow",
    ).take_all()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in greedy)
    for row in out:
        want = expected[row["id"]]
        assert list(row["completion_token_ids"]) == want["completion_token_ids"]
        assert (row["finish_reason"], row["error"]) == (want["finish_reason"], want["error"])
        source = next(r for r in greedy if r["id"] == row["id"])  # input columns are kept
        assert (row["max_tokens"], row["prompt_token_ids"] and list(row["prompt_token_ids"])) == (
            source.get("max_tokens"), source.get("prompt_token_ids"))


def test_ray_flag_without_ray_says_how_to_install(tmp_path, job_input):
    fake = tmp_path / "noray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
    inp, model = job_input
    proc = cbatch("run", str(inp), "--out", str(tmp_path / "o.jsonl"), "--model", str(model), "--ray", timeout=120,
                  PYTHONPATH=os.pathsep.join([str(fake.parent), str(ROOT)]))
    assert proc.returncode == 2
    assert 'pip install "cbatch[ray]"' in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("argv,expected", [
    (["run", "a.jsonl", "--out", "o", "--ray"], ["run", "a.jsonl", "--out", "o", "--ray=local"]),
    (["run", "--ray", "a.jsonl", "--out", "o"], ["run", "--ray=local", "a.jsonl", "--out", "o"]),
    (["run", "a", "--ray", "10.0.0.1:6379"], ["run", "a", "--ray", "10.0.0.1:6379"]),
    (["run", "a", "--ray", "auto", "-o", "x"], ["run", "a", "--ray", "auto", "-o", "x"]),
    (["run", "a", "--ray", "ray://head:10001"], ["run", "a", "--ray", "ray://head:10001"]),
    (["run", "a", "--ray", "--out", "o"], ["run", "a", "--ray=local", "--out", "o"]),
])
def test_ray_flag_takes_an_optional_address(argv, expected):
    assert normalize_ray_flag(argv) == expected


def test_an_address_nobody_answers_fails_fast():
    import socket

    from cbatch.run.preflight import JobError
    from cbatch.scaleout.ray_job import check_reachable

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(JobError, match=rf"--ray 127.0.0.1:{port}: no Ray cluster answers there"):
        check_reachable(f"127.0.0.1:{port}", timeout_s=2)


def test_image_rows_run_on_replicas_as_locally(ray_cluster, tmp_path):
    """Rows with images (chat image parts naming files, a `images` field, a file that does not exist) on two
    replicas: the local run's bytes, and the report's image counts over the replicas."""
    from cbatch.scaleout.ray_job import run_ray_job
    from vision_models import make_vl_checkpoint, png_bytes

    model = make_vl_checkpoint("qwen2_vl", tmp_path / "vl")
    for i, (h, w) in enumerate([(56, 84), (28, 28), (112, 56)]):
        (tmp_path / f"p{i}.png").write_bytes(png_bytes(h, w, seed=i))
    rows = []
    for i in range(8):
        page = str(tmp_path / f"p{i % 3}.png")
        content = [{"type": "image_url", "image_url": {"url": page}}, {"type": "text", "text": f"w{i} w{i + 1}"}]
        rows.append({"id": f"r{i}", "messages": [{"role": "user", "content": content}]} if i % 2 else
                    {"id": f"r{i}", "messages": [{"role": "user", "content": f"w{i}"}], "images": [page]})
    missing = str(tmp_path / "no.png")
    rows.append({"id": "missing", "messages": [{"role": "user", "content": "w5"}], "images": [missing]})
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reports = {}
    for name in ("local", "ray"):
        report = tmp_path / f"{name}.report.json"
        job = options(inp, tmp_path / f"{name}.jsonl", model, report=report)
        code = run_job(job) if name == "local" else run_ray_job(job, ray_options(block_rows=2))
        assert code == 1  # the missing image's row is an error row, as locally
        reports[name] = json.loads(report.read_text())
    assert (tmp_path / "ray.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    out = jsonl_records((tmp_path / "local.jsonl").read_text())
    assert "does not exist" in out[-1]["error"] and len({tuple(r["completion_token_ids"]) for r in out[:-1]}) > 4
    local, ray = reports["local"]["images"], reports["ray"]["images"]
    counts = ("rows", "images", "image_tokens")
    assert {k: ray[k] for k in counts} == {k: local[k] for k in counts}
    assert local["rows"] == 8 and local["image_tokens"] == 3 * 6 + 3 * 1 + 2 * 8
    assert 3 <= ray["encoded"] <= 6  # each replica encodes a page once, whichever of its rows comes first
