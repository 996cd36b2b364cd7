"""gRPC server of the remote attention op (see docs/service.md).

``python -m attention_service`` / ``attention-server`` runs it; tests use
``attention_service.server.create_server(config)``.
"""

from __future__ import annotations

__version__ = "0.1.0"
