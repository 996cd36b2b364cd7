"""Entry point: ``attention-server`` / ``python -m attention_service``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from attention_service.config import ServerConfig, load_config, usable_cpus
from attention_service.cpus import (
    allowed_cpus,
    format_cpu_list,
    host_cpus,
    pin_process,
    placement,
)

log = logging.getLogger("attention_service")


async def serve(config: ServerConfig) -> int:
    """The single-process model: front end and engine in this process."""
    from attention_service.server import create_server  # after logging is configured

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:  # before start-up, so a signal during warm-up still exits cleanly
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(create_server(config))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # a signal during warm-up: stop now, not after it (a minute)
        starting.cancel()  # create_server stops what it started
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        from attention_service.engine.warmup import exit_during_warmup

        exit_during_warmup(0)
    stopping.cancel()
    server, port = starting.result()
    # Parseable lines: tests and scripts read the bound ports from them.
    log.info("listening on port %d (backend %s, device %s, 1 process)", port,
             server.backend.name, server.backend.device_name)
    log.info("%s", config.describe_access(port))
    if server.metrics_port is not None:
        log.info("metrics on port %d", server.metrics_port)
    await stop.wait()
    log.info("shutting down: draining in-flight calls for up to %.1fs", config.grace_seconds)
    drain = asyncio.ensure_future(server.stop(config.grace_seconds))
    force = asyncio.Event()
    for sig in signals:  # a second signal skips the rest of the grace period
        loop.add_signal_handler(sig, force.set)
    forced = asyncio.ensure_future(force.wait())
    await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        log.warning("second signal: cancelling in-flight calls")
        await server.frontend.cut()
        await drain
    forced.cancel()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ValueError as exc:
        print(f"attention-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    from attention_service.errors import StartupError

    try:
        for flag, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key),
                           ("--tls-client-ca", config.tls_client_ca)):
            if path:  # read by every front end: refuse here, once, before any starts
                try:
                    with open(path, "rb"):
                        pass
                except OSError as exc:
                    raise StartupError(f"{flag}: {exc}") from None
        # One GPU per replica: before CUDA starts here, and inherited by the engine process.
        try:
            visible = config.visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
            log.info("driving GPU %s (--gpu %s)", visible, config.gpu)
        if config.device == "cuda":  # before anything starts
            from attention_service.engine.backends import resolve_device

            resolve_device(config.device)
        group = config.process_count > 1
        try:
            place = placement(config.engine_cpus, config.frontend_cpus, allowed_cpus(),
                              usable_cpus(), host_cpus(), group=group)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if group:
            from attention_service.ipc.group import run_group

            return run_group(config, place)
        if config.frontend_cpus:
            log.warning("--frontend-cpus is ignored: one process serves (--frontends 1)")
        if place.engine:
            pin_process(place.engine)
            log.info("running on CPUs %s (--engine-cpus)", format_cpu_list(place.engine))
        return asyncio.run(serve(config))
    except StartupError as exc:  # one line, as for a bad flag, not a traceback
        print(f"attention-server: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
