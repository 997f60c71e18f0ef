"""What a conversion killed outright (SIGKILL, power loss) leaves beside its destination is cleaned by the next run
into it; an interrupt after the new checkpoint is in place is not reported as "nothing was written".

Each temporary directory `.DST.tmp-XXXX` has an owner file `.DST.tmp-XXXX.owner` ("pid@host") beside it while it
is written (`convert.store.atomic_directory`); `clean_leftovers` acts only on owners that are dead processes of
this host.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from ckpt_helpers import leftovers
from convert import store
from convert.__main__ import main as cli_main
from kimi_jax.checkpoint import convert_checkpoint as convert

H = pytest.importorskip("hf_fixtures")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def kl_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("leftovers") / "kl_hf"
    H.make_kimi_linear(str(d), seed=0)
    return d


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _leftover(dst, pid: int, suffix: str = "dead", host: str | None = None):
    """A temporary directory (with one file) and its owner file, as a killed conversion into `dst` leaves them."""
    tmp = dst.parent / f".{dst.name}.tmp-{suffix}"
    (tmp / "params").mkdir(parents=True)
    (tmp / "params" / "half_written").write_text("x")
    (tmp.parent / (tmp.name + store.OWNER_SUFFIX)).write_text(f"{pid}@{host or socket.gethostname()}\n")
    return tmp


def test_a_killed_conversions_temp_dir_is_removed_by_the_next_run(kl_dir, tmp_path, monkeypatch):
    warned = []
    monkeypatch.setattr(store.log, "warning", lambda msg, *a: warned.append(msg % a if a else msg))
    dst = tmp_path / "dst"
    _leftover(dst, _dead_pid())
    convert(str(kl_dir), str(dst), progress=False)
    assert (dst / store.META_NAME).exists()
    assert leftovers(tmp_path) == []
    assert any("unfinished output of a killed conversion" in w for w in warned)


def test_live_and_foreign_owners_are_left_alone(tmp_path):
    dst = tmp_path / "dst"
    live = _leftover(dst, os.getppid(), "live")  # the pytest runner's parent: alive
    foreign = _leftover(dst, _dead_pid(), "foreign", host="another-host")  # may be a live job on a shared disk
    assert store.clean_leftovers(str(dst)) == []
    assert live.is_dir() and foreign.is_dir()


def test_killed_between_the_two_renames_puts_the_old_checkpoint_back(tmp_path):
    """--overwrite moves dst aside to `<tmp>.old`, then renames the new one in: killed in between, dst is missing
    and the old checkpoint is restored (the command never said it finished)."""
    dst = tmp_path / "dst"
    tmp = _leftover(dst, _dead_pid())
    old = tmp.parent / (tmp.name + ".old")
    old.mkdir()
    (old / "previous.txt").write_text("previous checkpoint")
    done = store.clean_leftovers(str(dst))
    assert (dst / "previous.txt").read_text() == "previous checkpoint"
    assert any("restored" in line for line in done)
    assert leftovers(tmp_path) == []


def test_an_interrupt_after_the_new_checkpoint_is_in_place(kl_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the replaced checkpoint is being removed: the new one is complete, the CLI says so (not
    "nothing was written"), and the next run into it removes the rest."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    real = store.shutil.rmtree

    def interrupted(path, *a, **k):
        if str(path).endswith(".old"):
            os.unlink(os.path.join(path, "old.txt"))  # part of it is gone when the interrupt arrives
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(store.shutil, "rmtree", interrupted)
    assert cli_main([str(kl_dir), str(dst), "--overwrite", "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "interrupted after" in err and "nothing was written" not in err
    assert (dst / store.META_NAME).exists() and not (dst / "old.txt").exists()
    monkeypatch.setattr(store.shutil, "rmtree", real)
    assert leftovers(tmp_path)  # the rest of the old one and its owner file, until the next run
    done = store.clean_leftovers(str(dst))
    assert any("already replaced" in line for line in done) and leftovers(tmp_path) == []
    assert (dst / store.META_NAME).exists()
