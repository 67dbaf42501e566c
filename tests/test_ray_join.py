"""`cbatch run --ray HOST:PORT` joining a cluster started the way Ray documents (`ray start --head`), from a shell
that knows nothing of it: Ray >= 2.59 starts such clusters with token authentication, and a process joining one
sends the token (from ~/.ray/auth_token here) only with RAY_AUTH_MODE=token, which cbatch sets for a cluster on
this machine when a token is there (as Ray does for a local cluster it finds itself), never for a remote address
the user did not opt in for. Without a token, the error says what to set. (tests/test_ray.py joins the cluster its own process started, whose
RAY_AUTH_MODE the child inherits: that hid the failure a new user saw.)"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ops_jobs import ROOT, write_jsonl

pytest.importorskip("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A head node of its own (HOME: a fresh folder, so its token is generated there), stopped at the end."""
    home = tmp_path_factory.mktemp("rayhome")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    port = _free_port()
    ray_cli = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]
    # a token in the default file (as any earlier local `ray.init()` of Ray >= 2.59 leaves one): `ray start` then
    # turns token authentication on, which a joining process honours only with RAY_AUTH_MODE=token
    subprocess.run(ray_cli + ["get-auth-token", "--generate"], env=env, capture_output=True, timeout=120)
    head = subprocess.Popen(ray_cli + ["start", "--head", "--port", str(port), "--num-cpus", "2", "--block",
                                       "--include-dashboard", "false", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the GCS port answers
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.5)
    else:
        os.killpg(head.pid, signal.SIGTERM)
        pytest.fail("ray start --head did not come up in 60 s")
    time.sleep(2)  # the raylet registers after the GCS
    yield f"127.0.0.1:{port}", env
    os.killpg(head.pid, signal.SIGKILL)  # the head and every process it started (its own session)
    head.wait(timeout=60)
    current = "/tmp/ray/ray_current_cluster"  # where `ray.init()` looks for a running cluster: not this dead one
    if os.path.exists(current) and str(port) in open(current).read():
        os.unlink(current)


def _run(address: str, env: dict, tmp_path, model) -> subprocess.CompletedProcess:
    rows = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [5, 6, 7, i + 8], "max_tokens": 3} for i in range(6)])
    return subprocess.run([sys.executable, "-m", "cbatch.cli", "run", str(rows), "--out", str(tmp_path / "out.jsonl"),
                           "--model", str(model), "--device", "cpu", "--token-ids", "--display", "none",
                           "--ray", address, "--replicas", "1", "--gpus-per-replica", "0"],
                          capture_output=True, text=True, env=env, timeout=300)


def test_joins_a_cluster_started_with_ray_start(ray_head, tiny_checkpoints, tmp_path):
    address, env = ray_head
    proc = _run(address, env, tmp_path, tiny_checkpoints["llama"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "6/6 rows ok" in proc.stdout
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 6


def test_without_the_token_the_error_says_where_it_goes(ray_head, tiny_checkpoints, tmp_path):
    import ray

    if tuple(int(x) for x in ray.__version__.split(".")[:2]) < (2, 59):
        pytest.skip("this Ray starts clusters without token authentication")
    address, env = ray_head
    elsewhere = tmp_path / "home"  # a user without the cluster's token
    elsewhere.mkdir()
    # Ray retries a refused join once a second, 20 times by default; RAY_gcs_server_port_wait_time_s is its
    # operator setting for that budget (ray/_private/node.py): 2 tries, as the refusal is the same every time
    quick = {"HOME": str(elsewhere), "RAY_gcs_server_port_wait_time_s": "2"}
    proc = _run(address, {**env, **quick}, tmp_path, tiny_checkpoints["llama"])
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cbatch: error: --ray {address}: cannot join that Ray cluster"), last
    assert "set RAY_AUTH_MODE=token with its token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN" in last
    assert "ray get-auth-token" in last and "Traceback" not in proc.stderr


@pytest.mark.parametrize("address, sent", [("127.0.0.1:6379", True), ("localhost:6379", True),
                                           ("ray://127.0.0.1:10001", True), ("10.1.2.3:6379", False)])
def test_the_token_goes_to_this_machine_only_unless_asked(address, sent, tmp_path, monkeypatch):
    from cbatch.scaleout.ray_job import ray_auth_token

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("f" * 64)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert ray_auth_token(address) == ("~/.ray/auth_token" if sent else None)
    assert os.environ.get("RAY_AUTH_MODE") == ("token" if sent else None)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # the user's opt-in sends it anywhere
    assert ray_auth_token("10.1.2.3:6379") == "~/.ray/auth_token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # and an explicit opt-out is respected
    assert ray_auth_token("127.0.0.1:6379") is None and os.environ["RAY_AUTH_MODE"] == "disabled"
