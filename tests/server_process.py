"""`python -m kimi_jax.serve` in a subprocess on a free 127.0.0.1 port, for tests that need a real server process
(signals, faked device counts). Its log goes to a file: a pipe nobody reads could fill up and block the server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# XLA:CPU ends a process when a collective has waited 40 s for one device's thread. With the suite on two workers
# beside multi-device subprocesses on 2 cores, a faked device's thread can be that late with nothing wrong; a real
# deadlock still ends the process, well inside pytest's timeout.
PATIENT_COLLECTIVES = "--xla_cpu_collective_call_terminate_timeout_seconds=900"


def cpu_devices_env(devices: int, **overrides) -> dict:
    """This environment with JAX on `devices` faked CPU devices (XLA_FLAGS) whose collectives wait patiently."""
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {PATIENT_COLLECTIVES}", **overrides)


def server_env(**overrides) -> dict:
    """The environment of a server subprocess: CPU JAX, unbuffered output, this checkout first on the path, no
    device count in XLA_FLAGS (a server fakes its CPU devices itself with --fake-cpu-devices), patient collectives."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **overrides)
    if "XLA_FLAGS" not in overrides:
        env["XLA_FLAGS"] = PATIENT_COLLECTIVES
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def wait_healthy(url: str, procs: list, logs: list, deadline: float) -> None:
    """Until `url`/health answers 200; an AssertionError with its log when one of the server's processes exits, or
    with every log when `deadline` (time.monotonic) passes."""
    tail = lambda path, n=4000: Path(path).read_text(errors="replace")[-n:]
    while time.monotonic() < deadline:
        for i, (proc, log) in enumerate(zip(procs, logs)):
            if proc.poll() is not None:
                raise AssertionError(f"server process {i} exited with {proc.returncode}:\n{tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("server not ready in time:\n" + "\n---\n".join(tail(log) for log in logs))


class ServerProcess:
    """One server process. `args`: the serve flags besides --port; `url` is its base address."""

    def __init__(self, log_path: Path, args: list):
        self.port = free_port()
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "kimi_jax.serve", "--port", str(self.port), *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=server_env(), stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, deadline: float) -> None:
        """Until /health answers 200, the process exits (an AssertionError with its log), or `deadline`
        (time.monotonic) passes."""
        wait_healthy(self.url, [self.proc], [self.log_path], deadline)

    def stop(self, graceful: bool = True) -> None:
        """SIGTERM and a bounded wait (then SIGKILL), or SIGKILL at once."""
        if self.proc.poll() is None:
            if graceful:
                self.proc.terminate()
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()
