"""Streaming rounds (Streaming DiLoCo): fragments synced at staggered steps, exchanges that
overlap local steps.

``federation.fragments=K`` splits the model's decoder blocks into ``K`` contiguous fragments
(block ``i`` of ``L`` belongs to fragment ``i * K // L``; the embeddings, and anything else
before the first block, go with the first fragment, the final norm and the output head with
the last). Fragment ``k`` is synced every ``every`` (= H) steps at its own offset
``o_k = (k + 1) * H // K`` (counted from the start of the phase): after steps ``o_k, o_k + H, ...``.
The offsets are spread evenly over the round and the last fragment syncs where a whole-model
round would (``K = 1`` is today's schedule), so about ``1/K`` of the model crosses at a time.

``federation.overlap_steps=tau``: fragment ``k``'s exchange starts ``tau`` steps before it is
applied, on a snapshot of the fragment taken then, and runs over process groups of its own
(the state's ``overlap_*``) while the local steps continue. No second thread ever issues NCCL:
on CUDA the training thread enqueues the exchange on a side stream (NCCL collectives only
enqueue work; the training stream waits for the side stream when the result is applied), and
with host tensors (gloo) a background thread runs it. When it is
applied the outer step is made on ``theta_global`` of the fragment with the snapshot's
pseudo-gradient, and the fragment becomes ``alpha * theta_local + (1 - alpha) * theta_global``
(``merge_alpha``; with ``tau = 0`` exactly ``theta_global``). ``tau < H / K`` keeps one
exchange in flight at a time: it is applied before the next one starts.

Per fragment: ``theta_global`` (one flat fp32 buffer over this rank's shards, ordered by
fragment, each fragment a contiguous slice), the outer optimizer's state (slices of one flat
state, each fragment with its own step count), the compression residual and the token
counts since its last exchange started. The last step of the job syncs every fragment at
once (without overlap), so the job ends with one model. Checkpoints are only taken after a
step's rounds are applied and before the next exchange starts: never with one in flight.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..config.schema import FederationConfig
from .clock import sync_offsets, synced_at
from .compress import CompressedMean
from .federation import Federation, compressed_exchange, sum_exchange
from .options import round_weights
from .protocol import Boundary
from .record import RoundRecord

__all__ = [
    "OverlappedExchange",
    "StreamingFederation",
    "fragment_of",
    "side_stream",
    "sync_offsets",
    "synced_at",
]

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def fragment_of(names: list[str], num_layers: int, fragments: int) -> list[int]:
    """Fragment of each parameter ``names[i]`` (model order): block ``b`` -> ``b * K // L``;
    before the first block -> 0; after a block -> the last fragment."""
    out, seen_block = [], False
    for name in names:
        m = _BLOCK.search(name)
        if m:
            seen_block = True
            out.append(int(m.group(1)) * fragments // num_layers)
        else:
            out.append(fragments - 1 if seen_block else 0)
    return out


def count_blocks(names: list[str]) -> int:
    """Decoder blocks of the model (distinct ``layers.<i>`` in its parameter names)."""
    return len({m.group(1) for m in map(_BLOCK.search, names) if m})


#: One side stream per (kind of exchange, device), made at its first exchange and kept: the caching allocator keeps
#: blocks per stream, so an exchange's buffers are reused by the next exchange of its kind (a new stream each time
#: could reuse none of them).
_SIDE_STREAMS: dict[tuple[str, torch.device], torch.cuda.Stream] = {}


def side_stream(kind: str, device: torch.device) -> torch.cuda.Stream:
    """The persistent side stream of exchanges of ``kind`` (``"fragment"``, ``"delayed"``) on CUDA ``device``."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if (kind, device) not in _SIDE_STREAMS:
        _SIDE_STREAMS[kind, device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[kind, device]


class OverlappedExchange:
    """``fn()`` run inline, or overlapped (``background``): on CUDA issued now by the training thread
    on the side stream of its ``kind`` (:func:`side_stream`), which first waits for the work already queued on
    the current stream (the snapshot), the current stream waiting for it at :meth:`result`; elsewhere in a daemon
    thread (host tensors, gloo groups: no NCCL from a second thread either way)."""

    def __init__(self, fn: Callable[[], Any], background: bool, device: torch.device, kind: str = "fragment"):
        self.fn, self.device, self.value, self.error, self._seconds = fn, device, None, None, 0.0
        self.stream, self.thread, self._events = None, None, None
        if background and device.type == "cuda":
            self.stream = side_stream(kind, device)
            self.stream.wait_stream(torch.cuda.current_stream(device))  # the snapshot is written
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            with torch.cuda.device(device), torch.cuda.stream(self.stream):
                self._events[0].record(self.stream)
                self._run()
                self._events[1].record(self.stream)
        elif background:
            self.thread = threading.Thread(target=self._run, name="xffl-fragment-exchange", daemon=True)
            self.thread.start()
        else:
            self._run()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by result() in the training thread
            self.error = exc
        self._seconds = time.perf_counter() - start

    @property
    def overlapped(self) -> bool:
        """Whether it runs beside the local steps (a thread, or a side stream)."""
        return self.thread is not None or self.stream is not None

    @property
    def seconds(self) -> float:
        """How long the exchange ran (on CUDA overlapped: on the side stream, between its events)."""
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1000
        return self._seconds

    def result(self) -> Any:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        if self.stream is not None:  # the training stream reads the result after the side stream wrote it
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return self.value


class StreamingFederation(Federation):
    """:class:`~.federation.Federation` with ``fragments > 1`` or ``overlap_steps > 0`` (see the module)."""

    _streaming = True

    def __init__(self, cfg: FederationConfig, model: torch.nn.Module, strategy, state, **span):
        """As :class:`~.federation.Federation`'s (``span``: its keyword arguments: hooks)."""
        super().__init__(cfg, model, strategy, state, **span)
        o, n = self.options, state.num_facilities
        K = o.fragments
        all_names = [name for name, _ in model.named_parameters()]
        frag = fragment_of(self.names, max(1, count_blocks(all_names)), K)
        order = sorted(range(len(frag)), key=lambda i: (frag[i], i))  # each fragment contiguous in theta
        self.names = [self.names[i] for i in order]
        self.params = [self.params[i] for i in order]
        self.locals = [self.locals[i] for i in order]
        self.fragment_index = [frag[i] for i in order]
        sizes = [sum(t.numel() for t, f in zip(self.locals, self.fragment_index) if f == k) for k in range(K)]
        self.bounds = [(sum(sizes[:k]), sum(sizes[: k + 1])) for k in range(K)]
        self._allocate_theta()
        self.fragment_outer = [self.outer.fragment(a, b) for a, b in self.bounds]
        self.residual = None
        self.compressors: list[CompressedMean | None] = [None] * K
        if o.compression != "none":
            if o.feedback:
                self.residual = torch.zeros(self.numel, dtype=torch.float32, device=state.device)
            for k, (a, b) in enumerate(self.bounds):
                comp = CompressedMean(o.compression, b - a, n, o.chunk_size, False, device=state.device)
                comp.residual = None if self.residual is None else self.residual[a:b]
                self.compressors[k] = comp
        self.tokens = torch.zeros(K, n, dtype=torch.float64, device=state.device)
        self.inflight: dict | None = None
        # The overlapped exchange runs beside the training thread's collectives: it needs groups
        # no one else uses (the state's overlap_*, built by build_state(..., overlap=True)). On CUDA
        # the training thread itself enqueues it on a side stream; with host tensors (gloo groups) a
        # background thread runs it (see OverlappedExchange).
        multi_replica = state.num_replicas > 1
        if o.overlap_steps > 0:
            self.peers = state.group("overlap_peers") if n > 1 else None
            self.replicas = state.group("overlap_replicas") if multi_replica else None
            # Connect them now, every rank at the same point (NCCL creates communicators lazily:
            # not in a background thread while the training thread runs its own collectives).
            for group in (self.peers, self.replicas):
                if group is not None:
                    dist.all_reduce(torch.zeros(1, device=state.device), group=group)
        else:
            self.peers = state.group("senders") if n > 1 else None
            self.replicas = state.group("replica") if multi_replica else None

    def describe(self) -> dict:
        o = self.options
        return {
            **super().describe(),
            "fragments": o.fragments,
            "overlap_steps": o.overlap_steps,
            "merge_alpha": o.merge_alpha,
        }

    # ------------------------------------------------------------------ schedule
    def trained(self, tokens: int) -> None:
        self.tokens[:, self.state.facility] += tokens

    def finish(self, boundary: Boundary, index: int) -> list[RoundRecord]:
        """Apply the fragments synced at ``boundary``: the one in flight, or (no overlap, and every fragment
        at the job's last step) exchanged now."""
        records, done, final = [], boundary.step, boundary.end
        for k in boundary.finish:
            self.hooks.save(index, "before")
            if self.inflight is None or final:
                self.wait()  # by construction nothing is in flight at the end; never two at once
                self._launch(k, done, index, background=False)
            elif self.inflight["fragment"] != k:
                raise RuntimeError(f"fragment {self.inflight['fragment']} in flight at the sync of fragment {k}")
            record = self._apply(done, index, blend=self.options.overlap_steps > 0 and not final)
            self.hooks.save(index, "after", bytes_per_rank=record.bytes_per_rank, fragment=k)
            records.append(record)
            index += 1
        return records

    def start(self, boundary: Boundary, index: int) -> None:
        """Start the exchange of the fragments synced ``overlap_steps`` after ``boundary`` (before the
        phase's end: the last step syncs without overlap)."""
        for k in boundary.start:
            self._launch(k, boundary.step, index, background=True)
            self.hooks.save(index, "start", fragment=k, step=boundary.step)

    def wait(self) -> None:
        if self.inflight is not None:
            self.inflight["work"].result()

    # ------------------------------------------------------------------ one fragment
    def _fragment_weights(self, k: int) -> list[float] | None:
        tokens = self.tokens[k].clone()
        self.tokens[k].zero_()
        return round_weights(self.options.mean_weights, tokens)

    def _read_range(self, a: int, b: int) -> Tensor:
        out = torch.empty(b - a, dtype=torch.float32, device=self.state.device)
        offset = 0
        for t in self.locals:
            lo, hi = max(a, offset), min(b, offset + t.numel())
            if lo < hi:
                out[lo - a : hi - a].copy_(t.reshape(-1)[lo - offset : hi - offset])
            offset += t.numel()
        return out

    def _write_range(self, a: int, flat: Tensor) -> None:
        b, offset = a + flat.numel(), 0
        for t in self.locals:
            lo, hi = max(a, offset), min(b, offset + t.numel())
            if lo < hi:
                t.reshape(-1)[lo - offset : hi - offset].copy_(flat[lo - a : hi - a])
            offset += t.numel()

    @torch.no_grad()
    def _launch(self, k: int, done: int, index: int, background: bool) -> None:
        """Start fragment ``k``'s exchange (numbered ``index``) on a snapshot taken now."""
        if self.inflight is not None and self.inflight["work"].overlapped:
            self.inflight["work"].result()
        started = time.perf_counter()
        state, n = self.state, self.state.num_facilities
        weights, skipped = self.hooks.weights_for_round(self._fragment_weights(k), index, done)
        if state.facility in skipped:
            # A facility left out restarts every fragment from the weights all facilities last agreed on.
            self._write_params(self.theta.to(state.device))
        scales = [1.0 / n] * n if weights is None else [w / sum(weights) for w in weights]
        compressed = self.compressors[k] is not None
        exchange = self._compressed_exchange(k, scales) if compressed else self._mean_exchange(k, scales)
        self.inflight = {
            "fragment": k,
            "step": done,
            "skipped": skipped,
            "compressed": compressed,
            "work": OverlappedExchange(exchange, background, state.device, kind="fragment"),
            "blocked": time.perf_counter() - started,
        }

    def _compressed_exchange(self, k: int, scales: list[float]) -> Callable[[], tuple[Tensor, int]]:
        """Fragment ``k``'s exchange: the compressed mean update ``theta_global - theta_f`` (the message
        prepared now)."""
        a, b = self.bounds[k]
        comp = self.compressors[k]
        message = comp.prepare(self._read_range(a, b).neg_().add_(self.theta[a:b].to(self.state.device)))
        return compressed_exchange(comp, message, b - a, scales, self.state, self.peers, self.replicas)

    def _mean_exchange(self, k: int, scales: list[float]) -> Callable[[], tuple[Tensor, int]]:
        """Fragment ``k``'s exchange: the weighted mean of the facilities' snapshots (taken now)."""
        a, b = self.bounds[k]
        snapshot = self._read_range(a, b).mul_(scales[self.state.facility])
        return sum_exchange(snapshot, self.state, self.peers, self.replicas)

    @torch.no_grad()
    def _apply(self, done: int, index: int, blend: bool) -> RoundRecord:
        started = time.perf_counter()
        flight, self.inflight = self.inflight, None
        k = flight["fragment"]
        a, b = self.bounds[k]
        result, sent = flight["work"].result()
        theta = self.theta[a:b]
        delta = result if flight["compressed"] else result.neg_().add_(theta.to(result.device))
        self.fragment_outer[k].step(delta.to(theta.device))
        new = theta.to(self.state.device)
        if blend:  # Streaming DiLoCo's merge of the local progress made while the exchange ran
            alpha = self.options.merge_alpha
            new = self._read_range(a, b).mul_(alpha).add_(new, alpha=1.0 - alpha)
        self._write_range(a, new)
        self.rounds += 1
        cross = self._sum_over_world(sent)
        return RoundRecord(
            index,
            done,
            k,
            started_step=flight["step"],
            seconds=flight["blocked"] + time.perf_counter() - started,
            exchange_seconds=flight["work"].seconds,
            bytes_per_rank=int(sent),
            cross_facility_bytes=int(cross),
            skipped_facilities=flight["skipped"],
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """As :meth:`Federation.state_dict`, with per-fragment outer step counts and token counts
        (``[fragments, facilities]``). Taken with no exchange in flight (see the module)."""
        if self.inflight is not None:
            raise RuntimeError("a checkpoint with a fragment exchange in flight: take it after the step's rounds")
        out: dict[str, Any] = {
            "rounds": torch.tensor(self.rounds),
            "tokens": self.tokens.clone(),
            "theta_global": self._as_dtensors(self.theta),
            "outer": {
                "steps": torch.tensor([p.steps for p in self.fragment_outer]),
                **{k: self._as_dtensors(v) for k, v in self.outer.buffers.items()},
            },
        }
        if self.residual is not None:
            out["residual"] = self._as_dtensors(self.residual)
        return out

    def load_state_dict(self, sd: dict) -> None:
        self.rounds = int(sd["rounds"])
        self.tokens.copy_(sd["tokens"])
        self._load_flat(self.theta, sd["theta_global"])
        for part, steps in zip(self.fragment_outer, sd["outer"]["steps"].tolist()):
            part.steps = int(steps)
        for k, v in self.outer.buffers.items():
            self._load_flat(v, sd["outer"][k])
        if self.residual is not None and "residual" in sd:
            self._load_flat(self.residual, sd["residual"])
