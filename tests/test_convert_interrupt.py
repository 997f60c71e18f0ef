"""`python -m convert` interrupted at any moment leaves nothing; a SIGKILLed one's leftovers are removed by the next
run, and only those it can prove are a dead process's (`convert.store`: owner file first, written atomically).

The conversion runs in a real subprocess with small Orbax parts (many saves), and is signalled once its temporary
directory exists, after several delays, so that the signal lands before, during and between the part saves.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ckpt_helpers import leftovers
from convert import store

H = pytest.importorskip("hf_fixtures")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def kl_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("interrupt") / "kl_hf"
    H.make_kimi_linear(str(d), seed=0)
    return d


def _start(src, dst) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "convert", str(src), str(dst), "--part-size", "20KB"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_tmp(proc, parent, name) -> bool:
    """Wait until the conversion's temporary directory exists; False if the process ended first."""
    deadline = time.monotonic() + 240
    while not any(n.startswith(f".{name}.tmp-") for n in os.listdir(parent)):
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the conversion never started writing"
        time.sleep(0.005)
    return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3, 1.0])
def test_an_interrupt_at_any_moment_leaves_nothing(kl_dir, tmp_path, sig, delay):
    proc = _start(kl_dir, tmp_path / "out")
    started = _wait_for_tmp(proc, tmp_path, "out")
    time.sleep(delay)
    if proc.poll() is None:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=240)
    if proc.returncode == 0:  # finished before the signal: a complete checkpoint and nothing else
        assert os.listdir(tmp_path) == ["out"] and (tmp_path / "out" / store.META_NAME).exists()
        return
    assert started
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err[-3000:]
    time.sleep(1.0)  # a writer thread still finishing would recreate the directory now
    assert os.listdir(tmp_path) == [], (os.listdir(tmp_path), err[-2000:])


def test_a_sigkilled_conversion_is_cleaned_by_the_next_run(kl_dir, tmp_path):
    proc = _start(kl_dir, tmp_path / "out")
    assert _wait_for_tmp(proc, tmp_path, "out")
    time.sleep(0.5)
    proc.kill()
    proc.wait(timeout=60)
    left = leftovers(tmp_path)
    assert any(n.endswith(store.OWNER_SUFFIX) for n in left), left  # the directory never lacks its owner file
    assert all(not os.path.isdir(tmp_path / n) or (tmp_path / (n + store.OWNER_SUFFIX)).exists()
               for n in left if not n.endswith(store.OWNER_SUFFIX))
    r = subprocess.run([sys.executable, "-m", "convert", str(kl_dir), str(tmp_path / "out"), "--part-size", "20KB"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "unfinished output of a killed conversion" in r.stderr
    assert os.listdir(tmp_path) == ["out"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_half_written_owner_file_of_a_dead_process_is_removed(tmp_path):
    """Killed between writing its owner file and renaming it into place: only the partial file is left, its
    writer named in its name."""
    me = socket.gethostname()
    dead = tmp_path / f".out.tmp-abcd{store.OWNER_SUFFIX}{store.PARTIAL_MARK}{_dead_pid()}@{me}"
    dead.write_text("")
    live = tmp_path / f".out.tmp-ef01{store.OWNER_SUFFIX}{store.PARTIAL_MARK}{os.getpid()}@{me}"
    live.write_text("")
    store.clean_leftovers(str(tmp_path / "out"))
    assert not dead.exists() and live.exists()


def test_a_directory_that_keeps_coming_back_keeps_its_owner_file(tmp_path, monkeypatch):
    """If the temporary directory cannot be made to stay removed (a writer still running), its owner file stays,
    so that a later run -- once the writer is gone -- can prove it stale and remove it."""
    dst = tmp_path / "out"
    monkeypatch.setattr(store, "remove_tree", lambda path, *a, **k: False)
    with pytest.raises(RuntimeError):
        with store.atomic_directory(str(dst), overwrite=False) as tmp:
            raise RuntimeError("conversion failed")
    assert os.path.isdir(tmp) and os.path.exists(tmp + store.OWNER_SUFFIX)
