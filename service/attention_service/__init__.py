"""gRPC server of the remote attention op (see docs/service.md).

``python -m attention_service`` / ``attention-server`` runs it; tests use
``attention_service.server.create_server(config)``.
"""

from __future__ import annotations

from attention_wire import grpc_defaults

# Before anything here imports grpc (see attention_wire.grpc_defaults); the front-end processes
# inherit the setting.
grpc_defaults.apply()

__version__ = "0.1.0"
