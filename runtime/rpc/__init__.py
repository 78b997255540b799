"""The gRPC glue both the tensor transport and the scheduler stand on: the
generated wire code (`wire/`, from proto/splitrun.proto), the names both ends
of a call agree on (`service`), the job's token checked before any handler
(`auth`), and TLS with the rule that an address off loopback needs it
(`tls`). It imports no torch: the launcher and its scheduler use it too."""

from __future__ import annotations

from splitrun.splitter.lazy_exports import lazy_exports

_EXPORTS = {
    "TokenInterceptor": ".auth",
    "one_line": ".auth",
    "TOKEN_METADATA_KEY": ".service",
    "TlsFiles": ".tls",
    "check_bind": ".tls",
    "is_loopback": ".tls",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
