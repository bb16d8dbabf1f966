"""``python -m xffl_like.hub`` (``xffl-hub``): a federation's identities and its hub.

- ``init DIR --facilities a,b [--host h1,h2] [GRANT]``: a CA, the hub's certificate (its SANs: ``--host``) and
  one certificate per facility (its common name: the facility's name);
- ``add DIR NAME [GRANT]``: one more facility (or a new certificate for a revoked one);
- ``GRANT`` (``--batch-size B --seq-len S --dp D --steps N``, any of them): what each facility named may claim,
  at most (``DIR/grants.json``; the hub re-reads it when it changes);
- ``revoke DIR NAME``: the hub refuses that facility from its next call, without a restart;
- ``serve --port P --certs DIR --state STATE [--bind ADDR] [--fresh] [--insecure]``: the hub.

Errors are one line (``error: ...``) and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from .certs import identity
from .errors import GRANT_KEYS, IdentityError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """Usage mistakes in one line too (``error: ...``, exit 2), naming the --help to read."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m xffl_like.hub", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("init", help="a CA, the hub's identity and one identity per facility")
    i.add_argument("dir")
    i.add_argument("--facilities", required=True, help="comma-separated facility names, e.g. leonardo,lumi")
    i.add_argument(
        "--host",
        action="append",
        help="names and addresses facilities dial (the hub's SANs), comma-separated or repeated "
        "(default: localhost,127.0.0.1)",
    )
    a = sub.add_parser("add", help="one more facility's identity")
    a.add_argument("dir")
    a.add_argument("name")
    for cmd in (i, a):
        for key in GRANT_KEYS:
            cmd.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"grant: the facility's {key}, at most")
    r = sub.add_parser("revoke", help="refuse a facility from its next call")
    r.add_argument("dir")
    r.add_argument("name")
    s = sub.add_parser("serve", help="run the hub")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--certs", help="the directory hub init wrote (mutual TLS)")
    s.add_argument("--state", required=True, help="where the federation is kept (created if missing)")
    s.add_argument("--bind", default="0.0.0.0", help="the address to listen on (default: every interface)")
    s.add_argument("--fresh", action="store_true", help="start a new federation, moving the old state aside")
    s.add_argument(
        "--insecure", action="store_true", help="plaintext on 127.0.0.1 only, names taken on trust (tests, demos)"
    )
    return p


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _grant(args) -> dict[str, int]:
    return {key: getattr(args, key) for key in GRANT_KEYS if getattr(args, key) is not None}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "init":
            hosts = [h for text in args.host or ["localhost,127.0.0.1"] for h in _split(text)]
            written = identity().init_dir(args.dir, _split(args.facilities), hosts)
            for name in _split(args.facilities) if _grant(args) else []:
                identity().write_grant(args.dir, name, _grant(args))
            print(f"wrote {len(written)} files to {args.dir}: ca.crt, ca.key, hub.crt, hub.key and facilities/ "
                  f"(keys mode 0600; keep ca.key on the hub's host)")  # fmt: skip
        elif args.command == "add":
            if _grant(args) and identity().is_issued(args.dir, args.name):  # a new grant for a facility already issued
                identity().write_grant(args.dir, args.name, _grant(args))
                print(f"facility {args.name}: its grant is now {_grant(args)} (the hub reads it at its next join)")
                return 0
            identity().add_facility(args.dir, args.name)
            if _grant(args):  # else its grant, if any, stays
                identity().write_grant(args.dir, args.name, _grant(args))
            print(f"facility {args.name}: {args.dir}/facilities/{args.name}.crt and .key (copy them to its site)")
        elif args.command == "revoke":
            serial = identity().revoke_facility(args.dir, args.name)
            print(f"facility {args.name} revoked (serial {serial}): the hub refuses it from its next connection")
        else:
            if not 0 < args.port < 65536:
                raise IdentityError(f"--port {args.port}: must be in 1..65535")
            from .server.serve import serve_main

            return serve_main(args)
    except IdentityError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except OSError as exc:  # a directory that cannot be written, a full disk
        where = f": {exc.filename}" if exc.filename else ""
        print(f"error: {args.command}: {exc.strerror or exc}{where}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
