"""Start-up objects are frozen out of later garbage collections (attention_service.heap)."""

from __future__ import annotations

import gc

from attention_service.heap import freeze_startup_heap


def test_freeze_moves_live_objects_to_the_permanent_generation() -> None:
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        kept = [object() for _ in range(10)]
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()


def test_a_server_freezes_its_heap_when_it_starts_serving(start_server) -> None:  # type: ignore[no-untyped-def]
    gc.unfreeze()
    try:
        srv = start_server()
        assert srv.stub() is not None
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
