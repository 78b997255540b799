"""The `Transport` protocol over gRPC between processes."""

from .transport import ExpectedChannel, GrpcSettings, GrpcTransport, expected_channels

__all__ = ["ExpectedChannel", "GrpcSettings", "GrpcTransport", "expected_channels"]
