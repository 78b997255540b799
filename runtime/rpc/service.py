"""The names both ends of a `TensorService` call agree on: the service's
method paths and the keys of the call metadata.
"""

from __future__ import annotations

from .wire import splitrun_pb2

__all__ = ["TOKEN_METADATA_KEY", "DELIVERED_METADATA_KEY", "SERVICE_NAME",
           "DELIVER_STREAM_METHOD", "PING_METHOD"]

TOKEN_METADATA_KEY = "splitrun-token"
# Trailing metadata of Deliver/DeliverStream: how many messages the server
# delivered to its mailbox, so the sender knows which message a refusal hit.
DELIVERED_METADATA_KEY = "splitrun-delivered"

SERVICE_NAME = splitrun_pb2.DESCRIPTOR.services_by_name["TensorService"].full_name
DELIVER_STREAM_METHOD = f"/{SERVICE_NAME}/DeliverStream"
PING_METHOD = f"/{SERVICE_NAME}/Ping"
