"""Serving from several processes: process 0 decides, every process runs the same device programs.

A multi-process JAX program is multi-controller: every process must launch the same programs, with the same
arguments, in the same order, each over its own devices (the collectives between them are inside the programs).
The engine schedules on process 0 only. So every device call it makes goes through a `Mirror`:

* on process 0 (the leader) a call is first published — its name and its arguments, device values replaced by
  references — and then run;
* every other process (a follower) runs `Mirror.follow`: it takes the calls in order and runs the same function
  on its own copies of the device values, which it keeps under the same references.

Device values are the jax Arrays the mirrored calls return (batch state, per-sequence caches, uploaded rows). Both
sides number the arrays a call returns in the order `jax.tree.leaves` gives them, so a reference never travels
back; when the leader drops an array, the next call tells the followers to drop theirs. Arrays made on every
process the same way before serving (the runner's tables) are `adopt`ed by both sides in the same order. Host
values (numpy arrays, numbers) travel as they are.

The channel is JAX's own distributed key-value store (`jax.distributed`; gRPC to the coordinator on process 0): one
key per call, read by each follower in turn, deleted in blocks once every follower has acknowledged it.

A process that dies is noticed by JAX's coordination service: the others stop at the next missed heartbeat
(`jax.distributed.initialize(heartbeat_timeout_seconds=…)`), with a non-zero exit, even when they wait inside a
collective; a follower whose call raises exits non-zero itself. Nothing waits forever.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import pickle
import threading
import weakref
from typing import Callable, Optional

import jax

log = logging.getLogger("kimi_jax.engine.multihost")

STOP = "__stop__"
BLOCK = 1024  # keys per directory of the store: a directory is deleted once every follower has read past it
ACK_EVERY = 64  # a follower acknowledges its progress every this many calls


class _Ref:
    """A device value in a published call: the number both sides gave it."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __reduce__(self):
        return (_Ref, (self.n,))


class Channel:
    """Ordered messages from process 0 to every other process over `jax.distributed`'s key-value store."""

    def __init__(self, client, *, process_id: int, num_processes: int, prefix: str = "kimi_jax/calls",
                 poll_ms: int = 60_000):
        self.client, self.rank, self.size, self.prefix = client, int(process_id), int(num_processes), prefix
        self.poll_ms = int(poll_ms)
        self.sent = 0  # leader: messages published
        self.received = 0  # follower: messages taken
        self._dropped_blocks = 0  # leader: directories deleted

    @classmethod
    def from_jax(cls, **kw) -> "Channel":
        """The channel over the running `jax.distributed` client (after `jax.distributed.initialize`)."""
        from jax._src import distributed  # the client is not public API; its key-value methods are stable

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed is not initialised: no key-value store to send calls over")
        return cls(client, process_id=jax.process_index(), num_processes=jax.process_count(), **kw)

    def _key(self, n: int) -> str:
        return f"{self.prefix}/{n // BLOCK}/{n}"

    def publish(self, payload: bytes) -> None:
        self.client.key_value_set_bytes(self._key(self.sent), payload)
        self.sent += 1
        if self.sent % BLOCK == 0:
            self._drop_read_blocks()

    def receive(self) -> bytes:
        """The next message; waits for it as long as it takes (an idle server sends nothing; a dead leader ends this
        process through JAX's heartbeat check)."""
        key = self._key(self.received)
        while True:
            try:
                payload = self.client.blocking_key_value_get_bytes(key, self.poll_ms)
                break
            except Exception as e:  # noqa: BLE001 -- the client raises XlaRuntimeError; only a timeout is retried
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise
        self.received += 1
        if self.received % ACK_EVERY == 0:
            self.client.key_value_set(f"{self.prefix}/ack/{self.rank}", str(self.received), allow_overwrite=True)
        return payload

    def _drop_read_blocks(self) -> None:
        """Delete every directory of calls that all followers have read."""
        acks = []
        for r in range(1, self.size):
            try:
                acks.append(int(self.client.key_value_try_get(f"{self.prefix}/ack/{r}")))
            except Exception:  # noqa: BLE001 -- not acknowledged anything yet
                acks.append(0)
        done = min(acks, default=self.sent) // BLOCK
        while self._dropped_blocks < done:
            self.client.key_value_delete(f"{self.prefix}/{self._dropped_blocks}")
            self._dropped_blocks += 1


class Mirror:
    """Named device calls, run here and (with a channel) on every process: see the module docstring.

    ``channel`` None: a single process; `register` returns the function itself and nothing is published. With a
    channel, process 0 is the leader (`register` returns a publishing wrapper) and the others call `follow`."""

    def __init__(self, channel: Optional[Channel] = None):
        self.channel = channel
        self.leader = channel is None or channel.rank == 0
        self._fns: dict[str, Callable] = {}
        self._lock = threading.RLock()  # publish and launch as one step: the order published is the order run
        self._next = 0  # the number the next device value gets (both sides count alike)
        self._ref_of: dict[int, int] = {}  # leader: id(array) -> its number
        self._objects: dict[int, jax.Array] = {}  # follower: number -> array
        self._released: collections.deque = collections.deque()  # leader: numbers dropped since the last call

    @property
    def multiprocess(self) -> bool:
        return self.channel is not None

    def register(self, name: str, fn: Callable) -> Callable:
        """Make ``fn`` a mirrored call under ``name`` (the same name and function on every process); returns what
        the caller should call instead of ``fn``."""
        if self.channel is None:  # one process: nothing to replay, so nothing to keep (a name may come again)
            return fn
        if name in self._fns:
            raise ValueError(f"device call {name!r} is registered twice")
        self._fns[name] = fn
        if not self.leader:
            return fn
        return functools.partial(self.call, name)

    def adopt(self, value) -> None:
        """Number the arrays of ``value``, made on every process alike outside any call (the same order on every
        process), so that calls can pass them."""
        self._number(value)

    # ------------------------------------------------------------------------------------------------ leader
    def call(self, name: str, *args, **kwargs):
        with self._lock:
            wire = jax.tree.map(self._to_wire, (args, kwargs))
            released = []
            while self._released:
                released.append(self._released.popleft())
            self.channel.publish(pickle.dumps((name, wire, released), protocol=pickle.HIGHEST_PROTOCOL))
            out = self._fns[name](*args, **kwargs)
            self._number(out)
            return out

    def stop(self) -> None:
        """Tell the followers to return from `follow` (the leader is shutting down)."""
        if self.channel is not None and self.leader:
            with self._lock:
                self.channel.publish(pickle.dumps((STOP, None, []), protocol=pickle.HIGHEST_PROTOCOL))

    def _to_wire(self, leaf):
        if isinstance(leaf, jax.Array):
            n = self._ref_of.get(id(leaf))
            if n is None:
                raise RuntimeError("a device value that no mirrored call produced was passed to a mirrored call: "
                                   "the other processes do not have it (make it through a registered call, or "
                                   "adopt it on every process)")
            return _Ref(n)
        return leaf

    def _release(self, key: int, n: int) -> None:  # weakref callback: any thread, during garbage collection
        self._ref_of.pop(key, None)
        self._released.append(n)

    # ------------------------------------------------------------------------------------------------ both
    def _number(self, value) -> None:
        for leaf in jax.tree.leaves(value):
            if not isinstance(leaf, jax.Array):
                continue
            n, self._next = self._next, self._next + 1
            if self.leader:
                if self.channel is not None:
                    self._ref_of[id(leaf)] = n
                    weakref.finalize(leaf, self._release, id(leaf), n)
            else:
                self._objects[n] = leaf

    # ------------------------------------------------------------------------------------------------ follower
    def follow(self) -> int:
        """Run the leader's calls until it stops; returns the number of calls run. A call that raises ends the
        process (exit 1): the leader would otherwise wait in its next collective until the heartbeat check."""
        if self.leader:
            raise RuntimeError("process 0 leads; only the other processes follow")
        ran = 0
        while True:
            name, wire, released = pickle.loads(self.channel.receive())
            for n in released:
                self._objects.pop(n, None)
            if name == STOP:
                log.info("process %d: the leader stopped after %d calls", self.channel.rank, ran)
                return ran
            try:
                args, kwargs = jax.tree.map(self._from_wire, wire, is_leaf=lambda x: isinstance(x, _Ref))
                self._number(self._fns[name](*args, **kwargs))
            except BaseException:  # noqa: BLE001 -- reported, then the whole run stops visibly
                log.exception("process %d: mirrored call %s (#%d) failed; exiting", self.channel.rank, name, ran)
                logging.shutdown()
                os._exit(1)
            ran += 1

    def _from_wire(self, leaf):
        if isinstance(leaf, _Ref):
            return self._objects[leaf.n]
        return leaf


# the runner's methods that launch device work: a multi-process server mirrors exactly these
RUNNER_CALLS = ("new_state", "new_cache1", "copy_cache1", "take_cache1", "prefill", "insert", "step", "verify",
                "copy_blocks", "put_rows", "update_class_masks")


class MirroredRunner:
    """A `ModelRunner` whose device calls go through a `Mirror` (process 0 of a multi-process server); everything
    else (shapes, compile, program names) is the runner's own."""

    def __init__(self, runner, mirror: Mirror):
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_calls", {name: mirror.register(f"runner.{name}", getattr(runner, name))
                                            for name in RUNNER_CALLS})
        mirror.adopt(runner.tables)

    def __getattr__(self, name):
        calls = object.__getattribute__(self, "_calls")
        if name in calls:
            return calls[name]
        return getattr(object.__getattribute__(self, "_runner"), name)

    def __setattr__(self, name, value):
        setattr(self._runner, name, value)


def mirror_runner(runner, mirror: Mirror):
    """Process 0: the runner to hand the engine. Other processes: registers the same calls (for `follow`) and
    returns the runner itself."""
    if mirror.leader:
        return MirroredRunner(runner, mirror)
    for name in RUNNER_CALLS:
        mirror.register(f"runner.{name}", getattr(runner, name))
    mirror.adopt(runner.tables)
    return runner
