"""The gRPC methods of :mod:`..protocol.wire`, thin: each decodes its message, asks the federation, encodes
the answer. Who is calling was checked before (:class:`.auth.IdentityInterceptor`: ``context.facility``),
and refusals become the call's status there too."""

from __future__ import annotations

import grpc

from ..protocol.messages import ArriveRequest, JoinRequest, Ok, ResultRequest, SessionRequest, UploadHeader
from ..protocol.wire import SERVICE, Frames
from .federation import HubFederation

__all__ = ["HubService"]


class HubService:
    """The hub's service over one :class:`HubFederation`."""

    def __init__(self, federation: HubFederation):
        self.fed = federation

    def join(self, request: bytes, context) -> bytes:
        return self.fed.join(context.facility, JoinRequest.decode(request)).encode()

    def beat(self, request: bytes, context) -> bytes:
        return self.fed.beat(context.facility, SessionRequest.decode(request)).encode()

    def arrive(self, request: bytes, context) -> bytes:
        return self.fed.arrive(context.facility, ArriveRequest.decode(request)).encode()

    def upload(self, request_iterator, context) -> bytes:
        frames = Frames(request_iterator, self.fed.expected_bytes, UploadHeader)
        return self.fed.upload(context.facility, frames, context.cancel).encode()

    def result(self, request: bytes, context):
        return self.fed.result(context.facility, ResultRequest.decode(request), context.is_active, context.cancel)

    def fetch(self, request: bytes, context):
        return self.fed.fetch(context.facility, SessionRequest.decode(request), context.cancel)

    def leave(self, request: bytes, context) -> bytes:
        self.fed.leave(context.facility, SessionRequest.decode(request))
        return Ok().encode()

    def handler(self) -> grpc.GenericRpcHandler:
        unary, stream_in, stream_out = (
            grpc.unary_unary_rpc_method_handler,
            grpc.stream_unary_rpc_method_handler,
            grpc.unary_stream_rpc_method_handler,
        )
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Join": unary(self.join),
                "Beat": unary(self.beat),
                "Arrive": unary(self.arrive),
                "Upload": stream_in(self.upload),
                "Result": stream_out(self.result),
                "Fetch": stream_out(self.fetch),
                "Leave": unary(self.leave),
            },
        )
