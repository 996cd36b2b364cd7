"""A front-end process of the process group: ``python -m attention_service.ipc.frontend_main``.

Started by the engine process (``ipc.group``) with two inherited descriptors: its end of the
channel and its arena. It never imports torch. It serves gRPC on the group's port
(``SO_REUSEPORT``: the kernel spreads connections over the front ends), forwards each request
to the engine, and exits:

* 0 after draining on SIGTERM (the engine forwards the group's SIGTERM; a second one cancels
  in-flight calls), SIGINT is left to the engine, which owns the group;
* 1 as soon as the engine's end of the channel closes (the engine died): in-flight calls fail
  with UNAVAILABLE and the process leaves rather than serve without an engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from attention_service.cpus import pin_process
from attention_service.ipc import arena as arenas
from attention_service.ipc.channel import Bound, Channel, Hello, recv_message
from attention_service.ipc.remote_link import RemoteLink

log = logging.getLogger("attention_service")


async def serve(hello: Hello, sock: socket.socket, arena_fd: int) -> int:
    from attention_service.frontend.server import start_frontend
    from attention_service.metrics import Metrics

    config = hello.config
    loop = asyncio.get_running_loop()
    arena = arenas.Mapped(arena_fd, hello.arena_bytes)
    os.close(arena_fd)
    link = RemoteLink(None, arena, hello.info, loop, spin_s=config.spin_seconds)
    metrics = Metrics(multiprocess=True)
    link.on_overflow = metrics.arena_overflows.inc
    channel = Channel(sock, link.on_message, link.on_close, f"frontend-{hello.slot}")
    link.channel = channel
    channel.start(loop)  # replies are read on this loop: no thread hand-off per call
    stop = asyncio.Event()
    force = asyncio.Event()

    def on_term() -> None:
        (force if stop.is_set() else stop).set()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    frontend = await start_frontend(config, link, metrics, reuse_port=True,
                                    slot=hello.slot)
    channel.send(Bound(hello.slot, frontend.port, os.getpid()))

    async def first(*events: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(e.wait()) for e in events]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()

    await first(link.serving, link.gone, stop)
    if link.serving.is_set() and not link.gone.is_set() and not stop.is_set():
        await frontend.set_serving()
        await first(link.gone, stop)
    if link.gone.is_set():
        log.error("front end %d: the engine process is gone (its channel closed); exiting",
                  hello.slot)
        await frontend.grpc_server.stop(0)
        return 1
    drain = asyncio.ensure_future(frontend.stop(config.grace_seconds))
    forced = asyncio.ensure_future(force.wait())
    await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        await frontend.cut()
        await drain
    forced.cancel()
    channel.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sock-fd", type=int, required=True)
    p.add_argument("--arena-fd", type=int, required=True)
    args = p.parse_args(argv)
    # The group's Ctrl-C reaches every process; the engine turns it into an ordered drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.sock_fd)
    try:
        hello, fds = recv_message(sock)
    except Exception as exc:  # the engine died before it said hello
        print(f"attention front end: no hello from the engine: {exc}", file=sys.stderr)
        return 1
    for fd in fds:
        os.close(fd)
    if hello.cpus:  # before grpc starts its threads (they inherit it)
        pin_process(hello.cpus)
    config = hello.config
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[frontend {hello.slot}] %(message)s",
        stream=sys.stderr,
    )
    return asyncio.run(serve(hello, sock, args.arena_fd))


if __name__ == "__main__":
    sys.exit(main())
