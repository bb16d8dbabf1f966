"""A facility's link to the lighthouse (``python -m xffl_like.lighthouse``).

torchft's Lighthouse decides membership: each facility's leader (its rank 0) heartbeats every
:data:`HEARTBEAT_S`; at a round boundary it asks for a quorum and gets the facilities that asked
and are alive. A member that stopped heartbeating (killed, or gone at walltime) is out of the
next quorum once the Lighthouse's heartbeat timeout has passed; a quorum whose previous members
all ask again forms at once.

What the Lighthouse does not keep lives in a TCPStore beside it (port + 1): which facility names
are in use (each with a counter its holder bumps every :data:`HEARTBEAT_S`: a name whose counter
stands still is free again), the federation's description (the first facility sets it, the
others must match), and the rendezvous of each round's standalone ``ProcessGroupGloo`` among the
facilities' leaders (one per quorum, prefixed by its id and creation time).

Why not torchft's Manager: it pairs ranks of equally sized replica groups and moves state
between equal shards; facilities here differ in size and sharding (FSDP/HSDP of any shape), so
the exchange is between the facilities' leaders, on full tensors (:mod:`.exchange`).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from .options import ElasticError, address, facility_name, federation_spec, first_difference

__all__ = ["HEARTBEAT_S", "Coordinator", "admit"]

#: Seconds between a facility's heartbeats (to the Lighthouse and its name's counter).
HEARTBEAT_S = 0.5
#: A name whose counter has not moved for this long is free (its holder is gone).
STALE_S = 6 * HEARTBEAT_S


def _store(cfg) -> dist.TCPStore:
    host, port = address(cfg.lighthouse)
    try:
        return dist.TCPStore(
            host, port + 1, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=float(cfg.timeout_s))
        )
    except (RuntimeError, OSError) as exc:
        raise ElasticError(
            f"federation.elastic.lighthouse={cfg.lighthouse}: no lighthouse answered within "
            f"federation.elastic.timeout_s={cfg.timeout_s:g} s ({str(exc).splitlines()[0][:120]}): start one with "
            f"`python -m xffl_like.lighthouse --port {port}` on {host}, or fix the address"
        ) from None


class _Beat:
    """A daemon thread calling ``beat()`` every :data:`HEARTBEAT_S` until :meth:`stop`."""

    def __init__(self, beat):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(beat,), daemon=True, name="xffl-heartbeat")
        self._thread.start()

    def _run(self, beat) -> None:
        while not self._stop.is_set():
            try:
                beat()
            except Exception:  # noqa: BLE001 - a missed beat is the Lighthouse's to judge
                pass
            self._stop.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def admit(job) -> _Beat:
    """In the launching process, before workers start: reach the lighthouse, take this facility's
    name and check the federation's description. Raises :class:`ElasticError` (one line). Returns
    the thread that keeps the name taken while this process lives."""
    cfg = job.federation.elastic
    name = facility_name(cfg)
    store = _store(cfg)
    mine = federation_spec(job)
    text = json.dumps(mine, sort_keys=True)
    theirs = json.loads(store.compare_set("federation/spec", "", text).decode())
    difference = first_difference(mine, theirs)
    if difference is not None:
        raise ElasticError(
            f"facility {name} does not match the federation at {cfg.lighthouse}: {difference}; run it "
            f"with the federation's settings (or start a new lighthouse for a new federation)"
        )
    token = uuid.uuid4().hex
    key, alive = f"facility/{name}", f"facility/{name}/alive"
    held = store.compare_set(key, "", token).decode()
    if held != token:  # taken: free again only if its holder stopped beating
        before = store.add(alive, 0)
        time.sleep(STALE_S)
        if store.add(alive, 0) != before:
            raise ElasticError(
                f"a facility named {name} is already in the federation at {cfg.lighthouse}: give this "
                f"one another name (federation.elastic.facility=NAME)"
            )
        store.set(key, token)
    return _Beat(lambda: store.add(alive, 1))


class Coordinator:
    """The leader's side: heartbeats, quorums, each round's process group, leaving. Leader only."""

    def __init__(self, cfg, name: str):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO
        from torchft.coordination import LighthouseClient

        self.cfg, self.name = cfg, name
        self.timeout = timedelta(seconds=float(cfg.timeout_s))
        host, port = address(cfg.lighthouse)
        self.store = _store(cfg)
        url = f"http://{host}:{port}"
        try:
            self.client = LighthouseClient(url, connect_timeout=self.timeout)
            beats = LighthouseClient(url, connect_timeout=self.timeout)  # its own connection, for its own thread
        except Exception as exc:  # noqa: BLE001 - torchft raises RuntimeError/OSError variants
            raise ElasticError(
                f"federation.elastic.lighthouse={cfg.lighthouse}: the lighthouse does not answer "
                f"({str(exc).splitlines()[0][:120]}): is `python -m xffl_like.lighthouse` running?"
            ) from None
        alive = f"facility/{name}/alive"

        def beat():
            beats.heartbeat(name)
            self.store.add(alive, 1)

        self._beat = _Beat(beat)

    def quorum(self, round_index: int, data: dict):
        """Ask for this round's quorum (blocks until it forms; retried while the Lighthouse answers).
        ``ElasticError`` once the Lighthouse has not answered for ``timeout_s``."""
        failing_since = None
        while True:
            try:
                return self.client.quorum(replica_id=self.name, timeout=self.timeout, step=round_index, data=data)
            except Exception as exc:  # noqa: BLE001 - no quorum yet (TimeoutError), or no answer at all
                if isinstance(exc, TimeoutError) and self._answers():
                    failing_since = None  # a live facility is on its way to the boundary
                    continue
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > self.timeout.total_seconds():
                    raise ElasticError(
                        f"the lighthouse at {self.cfg.lighthouse} stopped answering "
                        f"({str(exc).splitlines()[0][:120]}); restart it and this facility "
                        f"rejoins when started again"
                    ) from None
                time.sleep(HEARTBEAT_S)

    def _answers(self) -> bool:
        """Whether the lighthouse's host still answers (its store), after a quorum request timed out."""
        try:
            self.store.get("federation/spec")
            return True
        except Exception:  # noqa: BLE001 - unreachable: the caller counts it as not answering
            return False

    def group(self, quorum, rank: int) -> dist.ProcessGroupGloo:
        """The quorum's process group among the facilities' leaders (``rank`` in name order)."""
        created = quorum.created
        prefix = f"round/{quorum.quorum_id}/{created.seconds}.{created.nanos}"
        store = dist.PrefixStore(prefix, self.store)
        return dist.ProcessGroupGloo(store, rank, len(quorum.participants), self.timeout)

    def leave(self) -> None:
        """Stop heartbeating and give the name back: nobody waits for this facility any more."""
        self._beat.stop()
        try:
            self.store.set(f"facility/{self.name}", "")
        except Exception:  # noqa: BLE001 - the lighthouse is gone: nothing to leave
            pass
