"""Facilities as independent jobs: rounds among the facilities present (``federation.elastic``).

With ``federation.elastic.lighthouse=HOST:PORT`` each facility is its own job (its own launcher,
rendezvous and default process group; ``distributed.*`` describes this facility only). The
facilities meet at ``python -m xffl_like.lighthouse``:

- :mod:`.options`: the checks of ``federation.elastic`` (before workers start), the facility's
  name, the federation's description a joining facility must match;
- :mod:`.coordinator`: the facility leader's link to the lighthouse (torchft's Lighthouse for
  membership, heartbeats and each round's quorum; a TCPStore for names, the description and the
  rendezvous of each round's process group) and the launcher's admission;
- :mod:`.exchange`: :class:`ElasticFederation`, a round among the quorum's facilities (heal the
  ones behind from a live one, the weighted mean, outer step, compression), applied only once
  every member has the whole result.
"""

from .options import ElasticError, facility_name, federation_spec, validate_elastic

__all__ = ["ElasticError", "facility_name", "federation_spec", "validate_elastic"]
