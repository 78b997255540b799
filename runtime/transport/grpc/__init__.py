"""The `Transport` protocol over gRPC between processes."""

from .endpoint import GrpcSettings
from .transport import GrpcTransport

__all__ = ["GrpcSettings", "GrpcTransport"]
