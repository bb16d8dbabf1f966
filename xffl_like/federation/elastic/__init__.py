"""Facilities as independent jobs: rounds held by the hub (``federation.elastic``).

With ``federation.elastic.hub=HOST:PORT`` each facility is its own job (its own launcher, rendezvous
and default process group; ``distributed.*`` describes this facility only). Its leader dials out to
``python -m xffl_like.hub serve`` (:mod:`xffl_like.hub`), which holds the federation:

- :mod:`.options`: the checks of ``federation.elastic`` (before workers start), the facility's name;
  the federation's description a joining facility must match is :mod:`xffl_like.hub.protocol.spec`'s;
- the leader's gRPC link to the hub (mutual TLS, outbound only: join, heartbeats, arrive, upload, the
  round's result) is :mod:`xffl_like.hub.client`;
- :mod:`.exchange`: :class:`ElasticFederation`, this facility's side of each round (gather its shards,
  upload, take θ_global back to every rank);
- :mod:`.downlink`: with compression, a relayed round (the other facilities' messages) applied on the leader's
  files by the function the hub applies it with.
- :mod:`.delayed`: ``federation.delay=1``, each round's exchange in the leader's thread while the next round
  trains, landing at the next boundary by one of the two rules (``own_full``, ``eager``).
"""

from .options import ElasticError, facility_name, federation_spec, validate_elastic

__all__ = ["ElasticError", "facility_name", "federation_spec", "validate_elastic"]
