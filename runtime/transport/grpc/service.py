"""The names both ends of a `TensorService` call agree on: the service's
method paths and the keys of the call metadata.
"""

from __future__ import annotations

from ..wire import splitrun_pb2

__all__ = ["TOKEN_METADATA_KEY", "DELIVERED_METADATA_KEY"]

TOKEN_METADATA_KEY = "splitrun-token"
# Trailing metadata of Deliver/DeliverStream: how many messages the server
# delivered to its mailbox, so the sender knows which message a refusal hit.
DELIVERED_METADATA_KEY = "splitrun-delivered"

_SERVICE = splitrun_pb2.DESCRIPTOR.services_by_name["TensorService"].full_name
_DELIVER_STREAM = f"/{_SERVICE}/DeliverStream"
_PING = f"/{_SERVICE}/Ping"
