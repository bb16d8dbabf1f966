"""The federation hub: one port every facility dials out to, over mutual TLS (``python -m xffl_like.hub``).

See :mod:`.cli` (commands), :mod:`.identity`, :mod:`.wire`, :mod:`.federation`, :mod:`.store`, :mod:`.server`.
"""
