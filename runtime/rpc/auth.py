"""A server interceptor that checks the job's token before any handler runs,
and turns a handler's unexpected exception into one line.

gRPC's Python server runs interceptors on its polling thread, before a call
takes a worker thread or a concurrency slot; a handler, even one that only
checks the token, waits in a worker thread for the request body first. So a
caller without the token that opens a call and never sends its body would hold
a thread (and a slot the job's own peers need) if the check ran in the handler.
Here such a call gets a request-streaming handler that never reads the body and
answers UNAUTHENTICATED at once, whatever the method's arity.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable

import grpc

from .service import TOKEN_METADATA_KEY

__all__ = ["TokenInterceptor", "one_line"]

logger = logging.getLogger(__name__)

# Longest reason sent back to a caller.
_MAX_REASON = 300
# Refused calls are logged at most this often.
_LOG_EVERY_S = 1.0


def one_line(text: str, limit: int = _MAX_REASON) -> str:
    """The first line of `text`, cut to `limit` characters."""
    lines = str(text).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the job's token before any handler runs; wraps
    the handlers of accepted calls so an exception becomes INTERNAL with one
    line (the traceback goes to this process's log, never to the caller)."""

    def __init__(self, token: str, service: str, hint: str) -> None:
        self._token = token.encode()
        self._service = service  # "scheduler", "tensor server of [worker 1]"
        self._hint = hint        # how a process of this job gets the token
        self._lock = threading.Lock()
        self._last_logged = float("-inf")
        self._unlogged = 0

    def _log_refusal(self, reason: str, method: str) -> None:
        """Every refusal is logged, at most one line per `_LOG_EVERY_S` (a flood
        of refused calls must not flood the log)."""
        with self._lock:
            now = time.monotonic()
            if now - self._last_logged < _LOG_EVERY_S:
                self._unlogged += 1
                return
            more, self._unlogged, self._last_logged = self._unlogged, 0, now
        also = f" (and {more} more refused since the last report)" if more else ""
        logger.warning("%s (%s)%s", reason, method, also)

    def intercept_service(self, continuation, handler_call_details):
        sent = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                sent = value if isinstance(value, str) else ""
                break
        if not hmac.compare_digest(sent.encode(), self._token):
            what = "no token" if not sent else "a wrong token"
            reason = f"{self._service} refused a call with {what}; {self._hint}"
            self._log_refusal(reason, handler_call_details.method)
            return _refusal(reason)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _guarded(handler, self._service)


def _refusal(reason: str) -> grpc.RpcMethodHandler:
    def refuse(_request_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
    return grpc.stream_unary_rpc_method_handler(refuse)


def _guarded(handler: grpc.RpcMethodHandler, service: str) -> grpc.RpcMethodHandler:
    """The same handler, with unexpected exceptions mapped to INTERNAL."""
    if handler.unary_unary is not None:
        kind, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary
    elif handler.unary_stream is not None:
        kind, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
    elif handler.stream_unary is not None:
        kind, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
    else:
        kind, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
    streams_out = handler.response_streaming
    return kind(_wrap(behavior, service, streams_out),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _wrap(behavior: Callable, service: str, streams_out: bool) -> Callable:
    def fail(exc: Exception, context) -> None:
        code = context.code() if hasattr(context, "code") else None
        if code not in (None, grpc.StatusCode.OK):
            raise exc  # context.abort(): the status is set already
        logger.error("%s: a call failed inside its handler", service, exc_info=exc)
        context.abort(grpc.StatusCode.INTERNAL,
                      f"{service}: {type(exc).__name__}: {one_line(str(exc))}")

    if streams_out:
        def guarded_stream(request, context):
            try:
                yield from behavior(request, context)
            except Exception as exc:  # noqa: BLE001 - mapped to one status line
                fail(exc, context)
        return guarded_stream

    def guarded(request, context):
        try:
            return behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to one status line
            fail(exc, context)
    return guarded
