"""``python -m xffl_like.lighthouse``: the coordinator of an elastic federation (``federation.elastic``).

One long-lived process on a host every facility can reach (a login or service node, a small VM):

- torchft's Lighthouse on ``PORT``: membership, heartbeats and the quorum of each round;
- a ``torch.distributed.TCPStore`` on ``PORT + 1``: what the Lighthouse does not keep, namely the
  federation's description (model, algorithm, outer optimizer: a joining facility must match it),
  the facility names in use, and the rendezvous of each round's process group among the facilities.

Facilities point at it with ``federation.elastic.lighthouse=HOST:PORT``. It holds no model state:
restarting it loses nothing but the names in use and the federation's description (the next
facility to arrive sets it again). See docs/running.md, "Facilities as independent jobs".
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from datetime import timedelta

__all__ = ["DEFAULT_PORT", "serve"]

DEFAULT_PORT = 29510


def serve(
    port: int = DEFAULT_PORT,
    bind: str = "0.0.0.0",
    heartbeat_timeout_s: float = 5.0,
    join_timeout_s: float = 300.0,
    ready: threading.Event | None = None,
    stop: threading.Event | None = None,
):
    """Run the Lighthouse and the store until ``stop`` is set (or forever). ``ready`` is set once both listen."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO
    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    host = f"[{bind}]" if ":" in bind else bind
    lighthouse = LighthouseServer(
        bind=f"{host}:{port}",
        min_replicas=1,
        join_timeout_ms=int(join_timeout_s * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )
    store = dist.TCPStore(
        bind if bind not in ("0.0.0.0", "::") else "127.0.0.1",
        port + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )
    if ready is not None:
        ready.set()
    try:
        (stop or threading.Event()).wait()
    finally:
        lighthouse.shutdown()
        del store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xffl_like.lighthouse", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the Lighthouse's port; the store uses PORT+1")
    parser.add_argument("--bind", default="0.0.0.0", help="address to listen on (default: every interface)")
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=5.0,
        help="a facility whose leader sent no heartbeat this long is out of the next quorum",
    )
    parser.add_argument(
        "--join-timeout-s",
        type=float,
        default=300.0,
        help="how long a round waits for a live facility that has not reached its boundary yet "
        "(a slower facility); past it the round goes on without that one, which heals later",
    )
    args = parser.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        print('error: the lighthouse is torchft\'s: pip install -c constraints.txt -e ".[elastic]"', file=sys.stderr)
        return 2
    if not 0 < args.port < 65535:
        print(f"error: --port={args.port}: must be in 1..65534 (the store takes PORT+1)", file=sys.stderr)
        return 2
    stop, ready = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        thread = threading.Thread(
            target=serve,
            args=(args.port, args.bind, args.heartbeat_timeout_s, args.join_timeout_s, ready, stop),
            daemon=True,
        )
        thread.start()
        while not ready.wait(0.2):
            if not thread.is_alive():
                raise RuntimeError(f"could not listen on ports {args.port} and {args.port + 1}")
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}: is another lighthouse running there? choose another --port", file=sys.stderr)
        return 2
    import socket

    host = socket.getfqdn() if args.bind in ("0.0.0.0", "::") else args.bind
    print(
        f"lighthouse on {host}:{args.port} (store on {args.port + 1}); start each facility with "
        f"federation.elastic.lighthouse={host}:{args.port}",
        flush=True,
    )
    while not stop.wait(0.5):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
