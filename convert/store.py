"""The kimi_jax checkpoint directory: Orbax parts, metadata, atomic directory replacement.

Layout of a converted checkpoint `DST/`:

    kimi_jax_config.json        ModelConfig.to_json()
    kimi_jax_checkpoint.json    format version, architecture, dtype policy, one record per entry (HF source name,
                                kind, form, HF shape/dtype, stored arrays and the part holding them), copied files
    params/part_00000/ …        Orbax checkpoints (PyTreeCheckpointHandler, zarr3, OCDBT, uncompressed). Each holds
                                a nested dict of numpy arrays keyed by the parameter path split on "."
                                ("layers" → "3" → "self_attn" → "q_b_proj" → "kernel"); carried-through tensors
                                live under "extra" + their HF name. Any part restores on its own with
                                `orbax.checkpoint.StandardCheckpointer().restore(path)`.
    config.json, tiktoken.model, tokenizer_config.json, …   copied from the source

Arrays are grouped into parts of about `part_bytes` (default 1 GiB) so that conversion holds at most one part plus
the array being built in memory, while one Orbax save per array would mean thousands of tiny directories.
All arrays of one entry share a part.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket

import numpy as np
import orbax.checkpoint as ocp

from . import interrupt
from .errors import ConvertError

META_NAME = "kimi_jax_checkpoint.json"
CONFIG_NAME = "kimi_jax_config.json"
PARAMS_DIR = "params"
FORMAT = "kimi_jax_checkpoint"
FORMAT_VERSION = 2  # 2: routed experts are `block_sparse_moe.experts.{gate,up,down}` (1: w1 / w3 / w2)
DEFAULT_PART_BYTES = 1 << 30
RESERVED = {META_NAME, CONFIG_NAME, PARAMS_DIR}

log = logging.getLogger("convert")


def _checkpointer():
    import jax

    # numpy leaves; no defensive deep copy of each array (we keep them alive until the save returns);
    # no compression (weights barely compress and zstd would dominate the conversion time)
    try:
        numpy_handler = ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)
    except TypeError:  # orbax releases before the switch: they do not copy (found with the CUDA image's orbax)
        numpy_handler = ocp.type_handlers.NumpyHandler()
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, numpy_handler),
        (jax.Array, ocp.type_handlers.ArrayHandler()))
    handler = ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False, type_handler_registry=registry)
    return ocp.Checkpointer(handler)


def nest(flat: dict) -> dict:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}}, refusing names that would be both a leaf and a branch."""
    tree: dict = {}
    for name, value in flat.items():
        keys = name.split(".")
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConvertError(f"array name {name} collides with another array's name")
        if keys[-1] in node:
            raise ConvertError(f"array name {name} collides with another array's name")
        node[keys[-1]] = value
    return tree


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


class PartWriter:
    """Collects arrays and saves them as numbered Orbax parts of about `budget` bytes."""

    def __init__(self, root: str, budget: int = DEFAULT_PART_BYTES):
        self.dir = os.path.join(root, PARAMS_DIR)
        os.makedirs(self.dir, exist_ok=True)
        self.budget = max(1, int(budget))
        self.parts: list[str] = []
        self._cur: dict = {}
        self._cur_bytes = 0
        self._ck = _checkpointer()

    def reserve(self, nbytes: int) -> None:
        """Call before building an entry of about `nbytes`: saves the current part first if the entry would not fit,
        so the part in memory and the entry being built never exceed ~max(budget, entry) together."""
        if self._cur and self._cur_bytes + nbytes > self.budget:
            self.flush()

    def add(self, arrays: dict) -> int:
        """Queue one entry's arrays; returns the index of the part that will hold them."""
        nbytes = sum(a.nbytes for a in arrays.values())
        if self._cur and self._cur_bytes + nbytes > self.budget:
            self.flush()
        self._cur.update(arrays)
        self._cur_bytes += nbytes
        idx = len(self.parts)
        if self._cur_bytes >= self.budget:
            self.flush()
        return idx

    def flush(self) -> None:
        if not self._cur:
            return
        rel = os.path.join(PARAMS_DIR, f"part_{len(self.parts):05d}")
        path = os.path.join(os.path.dirname(self.dir), rel)
        # ocdbt_target_data_file_size=0: one chunk per array. Orbax otherwise splits arrays over 2 GB along their
        # largest axis, and chunks that are not contiguous in memory (e.g. lm_head [D, V] split along V) make
        # TensorStore copy the whole array while writing.
        # An interrupt is only recorded during the save and raised right after it: raised inside, it would leave
        # Orbax's / TensorStore's writer threads running, and they recreate the temporary directory after its
        # cleanup removed it.
        with interrupt.deferred():
            self._ck.save(path, args=ocp.args.PyTreeSave(item=nest(self._cur), ocdbt_target_data_file_size=0))
        interrupt.check()
        log.debug("wrote %s (%d arrays, %.1f MiB)", rel, len(self._cur), self._cur_bytes / 2**20)
        self.parts.append(rel)
        self._cur, self._cur_bytes = {}, 0

    def close(self) -> list[str]:
        self.flush()
        return self.parts


class PartReader:
    """Restores parts on demand, keeping the most recent one."""

    def __init__(self, root: str, parts: list[str]):
        self.root, self.parts = root, parts
        self._ck = _checkpointer()
        self._idx, self._arrays = None, None

    def get(self, idx: int) -> dict:
        if idx != self._idx:
            self._arrays = None  # free the previous part first
            if not 0 <= idx < len(self.parts):
                raise ConvertError(f"{self.root}: an entry names part {idx}, but the checkpoint lists "
                                   f"{len(self.parts)} part(s); its {META_NAME} is damaged")
            path = os.path.join(self.root, self.parts[idx])
            if not os.path.isdir(path):
                raise ConvertError(f"checkpoint part {path} is missing")
            try:
                self._arrays = flatten(self._ck.restore(path))
            except Exception as e:  # orbax / tensorstore errors on damaged parts
                raise ConvertError(f"cannot read checkpoint part {path}: {e}") from None
            self._idx = idx
        return self._arrays


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, META_NAME)
    if not os.path.isfile(meta_path):
        raise ConvertError(f"{path} is not a converted kimi_jax checkpoint (no {META_NAME})")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise ConvertError(f"{meta_path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ConvertError(f"{meta_path} must hold a JSON object, found {type(meta).__name__}")
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ConvertError(f"{meta_path}: unsupported checkpoint format {meta.get('format')!r} "
                           f"version {meta.get('version')!r} (expected {FORMAT} {FORMAT_VERSION}); convert the "
                           "source again")
    for key in ("parts", "entries"):
        if not isinstance(meta.get(key), list):
            raise ConvertError(f"{meta_path} is damaged: its {key!r} list is missing")
    return meta


def check_destination(dst: str, overwrite: bool, *, sources=()) -> None:
    """Refuse an existing destination without `overwrite`, and any destination inside / equal to a source."""
    for s in sources:
        s = os.path.realpath(s)
        d = os.path.realpath(dst)
        if d == s or d.startswith(s + os.sep) or s.startswith(d + os.sep):
            raise ConvertError(f"destination {dst} overlaps the source {s}; choose another directory")
    if os.path.lexists(dst) and not overwrite:
        raise ConvertError(f"destination {dst} already exists; pass --overwrite to replace it")
    up = os.path.dirname(os.path.abspath(dst))
    while not os.path.exists(up):  # the nearest existing ancestor must be a directory to create dst in
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise ConvertError(f"cannot create destination {dst}: {up} is not a directory")


OWNER_SUFFIX = ".owner"  # `<tmp>.owner` beside each temporary directory: "pid@host" of the process writing it
PARTIAL_MARK = ".partial-"  # `<tmp>.owner.partial-pid@host`: an owner file being written, renamed into place


def _me() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


def _owned_fresh_dir(prefix: str) -> tuple[str, str]:
    """(tmp, owner): a new directory `prefix` + a random suffix and, made BEFORE it, its owner file. The owner file
    is written under a name of its own and renamed into place, so it is never seen empty or half-written; a
    directory therefore never exists without a complete owner file, and `clean_leftovers` can prove a leftover's
    writer dead. The directory is made by a plain mkdir: the mode a user expects of their output (0777 less the
    umask; `tempfile.mkdtemp` would leave the finished checkpoint private, 0700)."""
    for _ in range(100):
        tmp = prefix + secrets.token_hex(4)
        owner = tmp + OWNER_SUFFIX
        if os.path.lexists(tmp) or os.path.lexists(owner):
            continue
        partial = f"{owner}{PARTIAL_MARK}{_me()}"
        with open(partial, "w") as f:
            f.write(_me() + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(partial, owner)
        try:
            os.mkdir(tmp)
        except FileExistsError:
            os.unlink(owner)
            continue
        return tmp, owner
    raise ConvertError(f"could not create a temporary directory {prefix}*")


def remove_tree(path: str, settle_s: float = 0.3, attempts: int = 20) -> bool:
    """Remove `path` and make sure it stays removed: a writer thread that was still finishing (Orbax / TensorStore)
    can recreate it right after `rmtree`. Returns whether it is gone (checked `settle_s` after the last removal)."""
    import time

    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        time.sleep(settle_s)
        if not os.path.lexists(path):
            return True
    return not os.path.lexists(path)


def _owner_alive(owner_file: str) -> bool:
    """Whether the process named in an owner file may still be writing (True when unsure: another host, unreadable)."""
    try:
        with open(owner_file) as f:
            return _process_alive(f.read().strip())
    except OSError:
        return True


def _process_alive(pid_at_host: str) -> bool:
    """Whether "pid@host" may still run (True when unsure: another host, malformed, not ours to signal)."""
    pid_s, _, host = pid_at_host.partition("@")
    try:
        pid = int(pid_s)
    except ValueError:
        return True
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owned_by_us(owner_file: str) -> bool:
    try:
        with open(owner_file) as f:
            return f.read().strip() == _me()
    except OSError:
        return False


def clean_leftovers(dst: str) -> list[str]:
    """Remove what a conversion into `dst` killed outright (SIGKILL, power loss) left beside it: its temporary
    directory, and — when it died between moving the old `dst` aside and renaming the new one in — put the old `dst`
    back (nothing is lost). Only directories whose owner file names a dead process of this host are touched.
    Returns what was done, one line each (also logged)."""
    dst = os.path.abspath(dst)
    parent, prefix = os.path.dirname(dst), f".{os.path.basename(dst)}.tmp-"
    done = []
    if not os.path.isdir(parent):
        return done
    for name in sorted(os.listdir(parent)):
        if name.startswith(prefix) and PARTIAL_MARK in name:  # an owner file killed before its rename
            writer = name.rpartition(PARTIAL_MARK)[2]
            if not _process_alive(writer):
                os.unlink(os.path.join(parent, name))
                done.append(f"removed {os.path.join(parent, name)} (an owner file a killed conversion was writing)")
            continue
        if not (name.startswith(prefix) and name.endswith(OWNER_SUFFIX)):
            continue
        owner = os.path.join(parent, name)
        if _owner_alive(owner) and not _owned_by_us(owner):
            continue
        tmp = owner[:-len(OWNER_SUFFIX)]
        old = tmp + ".old"
        if _owned_by_us(owner) and os.path.isdir(tmp):
            continue  # this process is writing it right now
        if os.path.isdir(old) and not os.path.lexists(dst):
            os.rename(old, dst)
            done.append(f"restored {dst} from {old} (a conversion was killed while replacing it)")
        elif os.path.lexists(old):
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old} (the checkpoint a killed conversion had already replaced)")
        if os.path.isdir(tmp):
            if not remove_tree(tmp):
                continue  # something still writes there: keep the owner file, a later run tries again
            done.append(f"removed {tmp} (the unfinished output of a killed conversion)")
        os.unlink(owner)
    for line in done:
        log.warning(line)
    return done


@contextlib.contextmanager
def atomic_directory(dst: str, overwrite: bool):
    """Yield a fresh temporary directory beside `dst`; on success rename it to `dst` (replacing an existing one only
    with `overwrite`), on any error or interrupt remove it, leaving nothing behind. What an earlier, killed run
    left is cleaned first (`clean_leftovers`)."""
    dst = os.path.abspath(dst)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    clean_leftovers(dst)
    # the owner file comes first and the directory after it, with interrupts only recorded meanwhile (the
    # `check` below raises one): a directory never exists without an owner file naming this process
    with interrupt.deferred():
        tmp, owner = _owned_fresh_dir(os.path.join(parent, f".{os.path.basename(dst)}.tmp-"))
    old = tmp + ".old"
    committed = False
    try:
        interrupt.check()  # one that came while the directory was being made: nothing written, nothing left
        yield tmp
        interrupt.check()  # an interrupt whose exception was swallowed on the way: still nothing is written
        if os.path.lexists(dst):
            if not overwrite:
                raise ConvertError(f"destination {dst} already exists; pass --overwrite to replace it")
            os.rename(dst, old)
            try:
                os.rename(tmp, dst)
            except BaseException:
                os.rename(old, dst)
                raise
            committed = True
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old, ignore_errors=True)  # an interrupt still stops it: see below
            else:
                os.unlink(old)
        else:
            os.rename(tmp, dst)
            committed = True
    except BaseException as e:
        if not committed:
            with interrupt.deferred():  # a second Ctrl-C must not cut the cleanup short
                if not remove_tree(tmp):
                    owner = None  # keep the owner file: the next run into dst removes what is left
        else:  # the new dst is complete; only the replaced one's removal was cut short: the CLI must not say
            # "nothing was written", and the next run's `clean_leftovers` removes the rest (the owner file stays)
            e.committed = dst
            owner = None
        raise
    finally:
        if owner is not None:
            with contextlib.suppress(OSError):
                os.unlink(owner)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def copy_side_files(src: str, dst: str, skip=()) -> list[str]:
    """Copy the non-weight top-level files (config.json, tiktoken.model, tokenizer_config.json, …)."""
    copied = []
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if (name.startswith(".") or not os.path.isfile(p) or name.endswith(WEIGHT_SUFFIXES)
                or name == "model.safetensors.index.json" or name in RESERVED or name in skip):
            continue
        shutil.copy2(p, os.path.join(dst, name))
        copied.append(name)
    return copied
