"""`--profile-dir`: POST /start_profile and /stop_profile record a jax.profiler trace of what the server runs in
between, behind the API key, one trace at a time; `bench/trace_summary.py` reads it back."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import httpx
import pytest

from kimi_jax.serve.app import build_app
from kimi_jax.serve.server import ServerThread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sk-profile"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def profiled(served, tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    srv = ServerThread(build_app(served.engine, served.tokenizer, model_name="tiny", api_key=KEY,
                                 profile_dir=str(root))).start()
    yield srv, root
    httpx.post(srv.url + "/stop_profile", headers=AUTH, timeout=120)  # a test that failed mid-trace: end it
    srv.stop()


def test_without_a_profile_dir_there_are_no_profile_endpoints(served):
    assert httpx.post(served.url + "/start_profile", timeout=30).status_code == 404
    assert httpx.post(served.url + "/stop_profile", timeout=30).status_code == 404


def test_a_trace_records_a_request_and_summarises(profiled):
    srv, root = profiled
    assert httpx.post(srv.url + "/start_profile", timeout=30).status_code == 401  # behind the key
    r = httpx.post(srv.url + "/stop_profile", headers=AUTH, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "profile_not_running"

    r = httpx.post(srv.url + "/start_profile", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    trace_dir = r.json()["trace_dir"]
    assert os.path.dirname(trace_dir) == str(root)
    again = httpx.post(srv.url + "/start_profile", headers=AUTH, timeout=30)
    assert again.status_code == 409 and again.json()["error"]["code"] == "profile_running"
    done = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=120,
                      json={"model": "tiny", "prompt": "trace me", "max_tokens": 4})
    assert done.status_code == 200
    r = httpx.post(srv.url + "/stop_profile", headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["trace_dir"] == trace_dir and r.json()["seconds"] > 0

    traces = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    assert traces, os.listdir(trace_dir)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "trace_summary.py"), trace_dir, "--top", "5",
                          "--steps", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "/host:CPU" in out.stdout and "| per step µs |" in out.stdout

    # the next trace goes into a directory of its own
    r = httpx.post(srv.url + "/start_profile", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["trace_dir"] != trace_dir
    assert httpx.post(srv.url + "/stop_profile", headers=AUTH, timeout=120).status_code == 200
