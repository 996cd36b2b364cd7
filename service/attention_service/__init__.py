"""gRPC server of the remote attention op (see docs/service.md).

``python -m attention_service`` / ``attention-server`` runs it; tests use
``attention_service.server.create_server(config)``.
"""

from __future__ import annotations

from attention_wire import grpc_defaults, malloc_tuning

# Before anything here imports grpc (see attention_wire.grpc_defaults); the front-end processes
# inherit the setting.
grpc_defaults.apply()
# Every server process (engine and front ends import this package) keeps large message
# buffers in its heap (attention_wire.malloc_tuning; ATTENTION_MALLOC_TUNING=0 to opt out).
malloc_tuning.apply(default=True)

__version__ = "0.1.0"
