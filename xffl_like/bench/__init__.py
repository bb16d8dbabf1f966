"""Benchmarks, each a ``python -m`` entry point; nothing here is imported by the job itself.

- ``python -m xffl_like.bench`` (:mod:`.aggregation`): the aggregation strategies against the
  limit of the transport (Hydra, ``conf/bench.yaml``).
- ``python -m xffl_like.bench.wan`` (:mod:`.wan`): the main job's federated algorithms across
  facilities separated by an emulated wide-area link (Hydra, ``conf/bench_wan.yaml``).
- ``python -m xffl_like.bench.parallel`` (:mod:`.parallel`): the data-parallel libraries of
  :mod:`xffl_like.parallel` against DDP, on loopback or across a shaped link.
- ``python -m xffl_like.bench.data`` (:mod:`.data`): the cost of making a batch against a
  training step, in one process.
- ``python -m xffl_like.bench.gpu`` (:mod:`.gpu`): the GPU checks (bf16, facilities over nccl, HSDP,
  streams, compression, streaming, decentralized and bagua, async checkpoints, meta init and HF
  export, tokens/s and MFU), each a job of the CLI; one line without a CUDA device.

:mod:`.netns` builds the emulated network (Linux network namespaces joined by rate-limited
veth links) that the last two use.
"""
