"""The `Transport` protocol over gRPC between processes."""

from __future__ import annotations

from splitrun.splitter.lazy_exports import lazy_exports

# Imported when first used: the transport (and torch) behind these names
# is needed only by the processes of a job.
_EXPORTS = {"GrpcSettings": ".settings", "GrpcTransport": ".transport"}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
