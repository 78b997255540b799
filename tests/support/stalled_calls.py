"""Calls that open and never send their body, as an attacker without the token
would make them: the server must answer each without waiting for the body."""

from __future__ import annotations

import threading

import grpc


class StalledCalls:
    """`count` calls to `method` at `address` with `metadata`, whose request
    stream never yields; `codes()` waits for every status (bounded)."""

    def __init__(self, address: str, method: str, count: int = 200, metadata=()) -> None:
        self._release = threading.Event()
        self._channel = grpc.insecure_channel(address)
        call = self._channel.stream_unary(method)
        self._futures = [call.future(self._never(), metadata=metadata, timeout=60)
                         for _ in range(count)]

    def _never(self):
        self._release.wait(120)
        return
        yield  # a generator that yields nothing

    def codes(self, timeout_s: float = 60.0) -> list[grpc.StatusCode]:
        codes = []
        for future in self._futures:
            error = future.exception(timeout=timeout_s)
            codes.append(grpc.StatusCode.OK if error is None else error.code())
        return codes

    def details(self) -> list[str]:
        return [f.exception(timeout=0).details() for f in self._futures if f.exception(timeout=0)]

    def close(self) -> None:
        self._release.set()
        for future in self._futures:
            future.cancel()
        self._channel.close()
