"""Tensors to peers on other hosts over TCP (TLS off loopback): the data
plane beside gRPC's control plane (see `transport`)."""

from .service import DATA_ADDRESS_METHOD, DataPlaneService, ask_data_port
from .settings import TcpSettings
from .transport import TcpTransport

__all__ = ["TcpTransport", "TcpSettings", "DataPlaneService", "ask_data_port",
           "DATA_ADDRESS_METHOD"]
