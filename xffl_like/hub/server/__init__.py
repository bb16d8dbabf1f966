"""The hub's server: one federation held for every facility that dials in (``python -m xffl_like.hub serve``).

- :mod:`.serve`: the process (its port, TLS, state directory, signals);
- :mod:`.auth`: the interceptor that checks each call's facility (certificate, revocation) before it runs;
- :mod:`.service`: the thin gRPC servicer (decode the message, ask the federation, encode the answer);
- :mod:`.federation`: :class:`~.federation.HubFederation`, the orchestration of the parts below;
- :mod:`.membership`: members, sessions, heartbeats, liveness;
- :mod:`.rounds`: a round's explicit state (an enum and its transitions) and each member's part in it;
- :mod:`.checks`: the checks of a contribution (claims, finiteness, update norm) and its weight;
- :mod:`.spool`: uploads written to files as they arrive, read back to average;
- :mod:`.fold`: one window of a round's commit (the aggregate, then the outer step);
- :mod:`.ahead`: a round's next version folded while its uploads stream in (the commit hidden behind them);
- :mod:`.journal`: a compressed round's durable record, its commit point (the version's file written behind it);
- :mod:`.relayed`: a compressed round's messages kept for its members (the relay downlink);
- :mod:`.store`: the durable state behind one interface (:class:`~.store.StateStore`; safetensors files);
- :mod:`.errors`: :class:`~.errors.HubError`, a refusal and its gRPC status.

It imports :mod:`xffl_like.hub.protocol` (never the facility's client) and, for the outer step,
:mod:`xffl_like.federation.outer`.
"""
