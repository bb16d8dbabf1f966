"""The hub's protocol: what the hub's server and a facility's client share, importing neither.

- :mod:`.wire`: the gRPC service on raw bytes, control messages as JSON, tensors as frames;
- :mod:`.messages`: each control message a frozen dataclass, its keys, types and bounds checked when decoded;
- :mod:`.spec`: the federation's description every facility shares, and its checks;
- :mod:`.update_codec`: a facility's update as it travels compressed (``federation.compression``);
- :mod:`.relay`: a compressed round's mean and outer step, applied by the hub and by every facility alike;
- :mod:`.retry`: the one retry policy (exponential backoff with full jitter) of every loop that asks again;
- :mod:`.dial`: the hub's address, and the error that keeps a facility out.
"""
