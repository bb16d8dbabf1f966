"""``federation.elastic``: its checks and the facility's name. The hub's address (:func:`address`), the error
that keeps a facility out (:class:`ElasticError`) and what a joining facility must match (the federation's
description, :func:`federation_spec`) are the hub's protocol's: :mod:`xffl_like.hub.protocol`."""

from __future__ import annotations

import math
import os
import socket

from ...config.checks import is_int, is_number
from ...config.errors import ConfigError
from ...hub.protocol.dial import ElasticError, address
from ...hub.protocol.spec import AGGREGATES, federation_spec, first_difference
from ..outer import AFFINE_OUTERS

__all__ = [
    "ElasticError",
    "address",
    "facility_name",
    "federation_spec",
    "first_difference",
    "validate_elastic",
]


def facility_name(cfg) -> str:
    """``federation.elastic.facility``, else its certificate's common name (with a hub), else
    ``xffl-<SLURM_JOB_ID>`` under Slurm, else the host's name."""
    if cfg.facility:
        return str(cfg.facility)
    if getattr(cfg, "cert", None):
        from ...hub.identity import peer_identity

        return peer_identity(open(cfg.cert, "rb").read())[0]
    job = os.environ.get("SLURM_JOB_ID")
    return f"xffl-{job}" if job else socket.gethostname().split(".")[0]


def validate_elastic(job, layout) -> None:
    """Check ``federation.elastic`` against the rest of ``job`` (``ConfigError``, one line)."""
    e, fed = job.federation.elastic, job.federation
    if not e.enabled:
        return
    _validate_hub(e, fed)
    if e.facility is not None and (
        not isinstance(e.facility, str) or not e.facility.strip() or any(c in e.facility for c in "/ \t\n")
    ):
        raise ConfigError(
            f"federation.elastic.facility={e.facility!r}: a name without spaces or '/', e.g. "
            f"federation.elastic.facility=leonardo"
        )
    if not is_int(e.min_facilities) or e.min_facilities < 1:
        raise ConfigError(f"federation.elastic.min_facilities={e.min_facilities!r}: must be an integer >= 1")
    for key in ("timeout_s", "final_wait_s"):
        v = getattr(e, key)
        if not is_number(v) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"federation.elastic.{key}={v!r}: must be a number of seconds > 0")
    if not isinstance(e.rewarm, bool):
        raise ConfigError(f"federation.elastic.rewarm={e.rewarm!r}: must be true or false")
    if layout.num_facilities != 1:
        raise ConfigError(
            f"federation.elastic.hub: each facility is its own job, so distributed.* describes "
            f"this facility only; set distributed.federated=null (now {job.distributed.federated!r})"
        )
    refused = {
        "federation.algorithm=synchronous": fed.algorithm != "federated",
        f"federation.topology={fed.topology}": fed.topology != "complete",
        "federation.fragments / overlap_steps": fed.streaming,
        "federation.schedule": fed.schedule is not None,
        "a list in federation.weights": isinstance(fed.weights, (list, tuple)),
        f"parallel={job.parallel.name}": job.parallel.name != "fsdp",
    }
    _refuse_first(
        refused,
        lambda what: (
            f"{what} does not work with federation.elastic.hub (rounds among the facilities present): "
            f"use rounds of averaging or an outer optimizer, with weights uniform or tokens"
        ),
    )
    _validate_delay(fed)


def _refuse_first(refused: dict[str, bool], says) -> None:
    """The first setting of ``refused`` whose flag holds, as one :class:`ConfigError` line ``says(setting)``."""
    for what, bad in refused.items():
        if bad:
            raise ConfigError(says(what))


def _validate_delay(fed) -> None:
    """``federation.delay=1`` through the hub: rounds of a fixed ``every`` (federation/elastic/delayed.py)."""
    if fed.delay != 1:
        return
    if fed.every_s is not None:
        raise ConfigError(
            "federation.delay=1 with federation.every_s through federation.elastic.hub: a delayed round lands at the "
            "next boundary of a fixed federation.every; set federation.every_s=null, or delay=0"
        )
    if (fed.delay_rule or "eager") != "eager":
        return
    refused = {
        f"federation.outer.name={fed.outer.name}": fed.outer.name not in AFFINE_OUTERS,
        f"federation.elastic.aggregate={fed.elastic.aggregate}": fed.elastic.aggregate != "mean",
    }
    _refuse_first(
        refused,
        lambda what: (
            f"federation.delay=1 with delay_rule=eager and {what} through federation.elastic.hub: the hub "
            f"carries the rounds' means, which each facility's outer step ({', '.join(AFFINE_OUTERS)}) takes, and "
            f"its final round is the mean of their ends; use federation.delay_rule=own_full, or a mean with one of "
            f"those outer rules"
        ),
    )


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _validate_hub(e, fed) -> None:
    """``federation.elastic.hub`` and its identity files (read and checked here, before workers start)."""
    host, _ = address(e.hub, "federation.elastic.hub")
    given = [k for k in ("ca", "cert", "key") if getattr(e, k) is not None]
    if given and len(given) != 3:
        missing = ", ".join(f"federation.elastic.{k}" for k in ("ca", "cert", "key") if k not in given)
        raise ConfigError(
            f"federation.elastic.hub needs ca, cert and key together; {missing} missing (the files "
            f"`python -m xffl_like.hub init DIR` wrote: DIR/ca.crt, DIR/facilities/NAME.crt and .key)"
        )
    if not given and host not in _LOOPBACK:
        raise ConfigError(
            f"federation.elastic.hub={e.hub}: give federation.elastic.ca, cert and key (mutual TLS); only a "
            f"hub on loopback started with `serve --insecure` takes plaintext (tests and one-machine demos)"
        )
    if given:
        from ...hub.identity import IdentityError, check_facility_identity

        try:
            check_facility_identity(e.ca, e.cert, e.key, e.facility)
        except IdentityError as exc:
            raise ConfigError(str(exc)) from None
    for key, lo in (("grace_s", 0.0), ("max_norm_ratio", 1.0)):
        v = getattr(e, key)
        if not is_number(v) or not math.isfinite(v) or v <= lo:
            raise ConfigError(f"federation.elastic.{key}={v!r}: must be a number > {lo:g}")
    if e.aggregate not in AGGREGATES:
        raise ConfigError(f"federation.elastic.aggregate={e.aggregate!r}: must be one of {', '.join(AGGREGATES)}")
    if not is_number(e.trim) or not 0 <= e.trim < 0.5:
        raise ConfigError(f"federation.elastic.trim={e.trim!r}: must be a fraction in [0, 0.5)")
