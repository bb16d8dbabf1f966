"""The federation hub: one port every facility dials out to, over mutual TLS (``python -m xffl_like.hub``).

- :mod:`.protocol`: what both ends share and nothing else (wire format, messages, the federation's
  description, update codecs, the retry policy);
- :mod:`.server`: the hub (``serve``): identity in an interceptor, a thin servicer, the federation's parts;
- :mod:`.client`: a facility leader's side (:class:`~.client.HubLink`);
- :mod:`.identity`: certificates and revocation; :mod:`.cli`: the commands.

The server and the client import :mod:`.protocol`, never each other.
"""
