"""The engine's NIXL agent: NIXL regions' bytes moved between a client's memory (any host) and
the engine's mirror of it (``regions.py``, kind "nixl"; issue 66).

NIXL (PyPI ``nixl-cu13``, UCX inside) is optional: without it the server refuses NIXL regions
(FAILED_PRECONDITION) and serves everything else. The agent is made on the first NIXL region.
Clients' agents are known by name (ConnectNixl: their connection metadata, once per agent);
each NIXL region adds its own memory's metadata. A name belongs to the caller (token) that
connected it while the server knows it: while it has regions, and idle up to
``MAX_IDLE_PEERS`` per caller.

A transfer is one descriptor list per direction and call (every span of one peer at once),
waited for on the calling thread, with a deadline: a peer that died mid-transfer fails that
call (UNAVAILABLE naming the field), never the server.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from attention_service.engine import ucx_choices
from attention_service.engine.nixl_vet import (
    BACKEND,
    NIXL_MODULE,
    MetadataVetter,
    Unread,
    metadata_agent,
)
from attention_service.errors import RequestError, invalid

log = logging.getLogger("attention_service")

# How long one transfer may take before its call fails: a peer gone mid-transfer would
# otherwise hold the call (and the thread that waits for it) forever.
TRANSFER_TIMEOUT_S = 60.0
# Polls of a transfer's state before the waiter starts sleeping between polls: a 4 KiB
# transfer between two processes finishes in 13-90 us (dev box, UCX over shared memory).
_SPIN_POLLS = 200
# How often transfers read UCX's log for new transport choices and warnings (a read is a file
# open; a metrics scrape reads it too).
UCX_READ_S = 1.0
# Agents without regions kept known per caller (connected: a client registers its next region
# without ConnectNixl again); the oldest idle one goes when there are more.
MAX_IDLE_PEERS = 16
# Seconds a caller waits before its next metadata is read, after one crashed or stalled the
# metadata helper (nixl_vet).
VET_BACKOFF_S = 1.0
# Seconds a caller's blob waits for another of theirs in the helper (a few ms when good)
# before it is UNAVAILABLE: a waiting registration holds one of the engine's few control
# threads.
VET_WAIT_S = 0.5


def available() -> bool:
    """Whether NIXL can be imported here (the ``nixl-cu13`` wheel)."""
    return importlib.util.find_spec(NIXL_MODULE) is not None


def backend_name() -> str:
    """The backend, and UCX's transports when this process restricts them (UCX_TLS). The
    transport UCX picks for each peer is known only once it moved bytes: ``transports``."""
    tls = os.environ.get("UCX_TLS", "")
    return f"{BACKEND} UCX_TLS={tls}" if tls else BACKEND


def _refusal(field: str, name: str, kind: str, detail: str) -> RequestError:
    """Why NIXL would not take agent ``name``'s metadata (it raised ``kind``; ``detail`` its
    message): its backend failing to set up the connection is UNAVAILABLE, which clients
    retry (seen once, a client's ConnectNixl after a server restart in a CI run on a loaded
    2-core box; the same test passes alone); anything else is not metadata NIXL can read,
    INVALID_ARGUMENT."""
    if kind == "nixlBackendError":
        return RequestError(
            grpc.StatusCode.UNAVAILABLE,
            f"{field}: this server's NIXL could not connect to agent {name!r} ({detail}); "
            "try again, and check that the agent's host is reachable from this server")
    return invalid(field, f"not NIXL agent metadata ({kind})")


# One span to move: (address, bytes, device id).
Span = tuple[int, int, int]
# An op's direction, as the metrics label it: "in" pulled from a client, "out" pushed back.
DIRECTIONS = {"READ": "in", "WRITE": "out"}
# Called after each transfer with (direction, bytes, seconds): the metrics.
Observe = Callable[[str, int, float], None]


class NixlAgent:
    """The engine's agent and the peers (clients' agents) it knows, by owner. Thread-safe."""

    def __init__(self, observe: Observe | None = None, enabled: bool = True) -> None:
        self.enabled = enabled  # --nixl
        self._lock = threading.Lock()
        self._agent: Any = None
        self.name = ""  # the agent's, once made
        self._observe = observe
        # Peer name -> [owner, regions using it, last change (monotonic s), the blob that
        # connected it (its connection info, which a region's own blob is read after)].
        self._peers: dict[str, list[Any]] = {}
        self._vetter = MetadataVetter()
        # Caller -> when a blob of theirs last crashed or stalled the helper: its next blob is
        # read only ``VET_BACKOFF_S`` later, so one caller's bad blobs (each costs a new
        # helper, ~0.6 s of CPU, or up to 20 s of the helper's time) cannot hold the others'.
        self._vet_failed: dict[str, float] = {}
        self._vetting: set[str] = set()  # callers with a blob in the helper now: one each
        self._vet_done = threading.Condition(self._lock)  # one of theirs left the helper
        self._ucx = ucx_choices.UcxChoices(None, "")  # the transports UCX picked, once made
        self._ucx_read_at = 0.0  # when a transfer last read them (monotonic s)

    def _nixl(self) -> Any:
        """The agent, made on first use. Raises FAILED_PRECONDITION without NIXL."""
        if self._agent is None:
            if not self.enabled:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "nixl: NIXL regions are off on this server (--no-nixl): register a system "
                    "or cuda region, or send the bytes")
            if not available():
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "nixl: this server has no NIXL (pip install nixl-cu13 on the server's "
                    "host): register a system or cuda region, or send the bytes")
            name = self.name = f"attention-server-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            with ucx_choices.loading(name) as self._ucx:  # UCX reads its settings as it loads
                self._agent = self._make_agent(name)
            log.info("nixl agent %s up (backend %s)", name, BACKEND)
        return self._agent

    @staticmethod
    def _make_agent(name: str) -> Any:
        """A NIXL agent with the UCX backend, or FAILED_PRECONDITION saying why not."""
        nixl = importlib.import_module(NIXL_MODULE)
        # RW: transfers from several mover threads at once; registrations and peers
        # change under the writer's side (the default without a listener thread is no
        # locking at all).
        # No progress thread: NIXL's spins a whole core for the process's life (measured:
        # 1.0 CPU s per s, idle), and the side that starts every transfer does not need
        # one (its waiter drives it). The clients' agents, whose memory is read, do.
        config = nixl.nixl_agent_config(
            enable_prog_thread=False, backends=[BACKEND],
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        try:
            return nixl.nixl_agent(name, config)
        except Exception as exc:  # UCX found no transport it may use (UCX_TLS, ...)
            log.error("nixl could not start its %s backend: %s", BACKEND, exc)
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "nixl: the server's NIXL could not start its UCX backend (its UCX_TLS / "
                "UCX_NET_DEVICES settings): NIXL regions are unavailable") from None

    # ---- peers --------------------------------------------------------------------------

    def connect(self, owner: str, name: str, metadata: bytes) -> None:
        """ConnectNixl: know client agent ``name`` for ``owner`` (``metadata`` its connection
        metadata, or its full metadata). Again for a known agent: its metadata is added."""
        self._add(owner, name, metadata, "agent_name", "agent_metadata", regions=0)

    def add_peer(self, owner: str, name: str, metadata: bytes) -> None:
        """A NIXL region of ``owner``'s agent ``name`` (``metadata``: the region's memory, or
        the agent's full metadata); counted: ``drop_peer`` once per region."""
        self._add(owner, name, metadata, "nixl.agent_name", "nixl.agent_metadata", regions=1)

    def _add(self, owner: str, name: str, metadata: bytes, name_field: str, md_field: str,
             regions: int) -> None:
        if not name:
            raise invalid(name_field, "missing: name the agent whose metadata this is")
        if not metadata:
            raise invalid(md_field, "missing: send the agent's NIXL metadata")
        with self._lock:
            self._nixl()  # first: a server whose NIXL cannot start says so
            self._peer_for(owner, name, metadata, name_field, md_field)  # refusals don't wait
            # One blob per caller in the helper at a time, and none for a while after one of
            # theirs crashed or stalled it: a caller's bad blobs, sent at once or in a row,
            # cost the helper one failure per VET_BACKOFF_S, and other callers' blobs go on.
            if not self._vet_done.wait_for(lambda: owner not in self._vetting,
                                           timeout=VET_WAIT_S):
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   f"{md_field}: the server is still reading another NIXL "
                                   "blob of this caller's: try again")
            wait = self._vet_failed.get(owner, -VET_BACKOFF_S) + VET_BACKOFF_S - time.monotonic()
            if wait > 0:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{md_field}: this caller's last NIXL metadata crashed or stalled the "
                    f"server's metadata helper: try again in {wait:.1f} s")
            peer = self._peer_for(owner, name, metadata, name_field, md_field)  # after waiting
            conn = None if peer is None else peer[3]
            self._vetting.add(owner)
        # NIXL's parser can crash on bad bytes: a helper process reads them first, outside
        # the lock (a blob it takes long on holds no other caller's registration).
        try:
            answer = self._vetter.check([metadata] if conn is None else [conn, metadata])
        except Unread as exc:
            with self._lock:
                self._vet_failed[owner] = time.monotonic()
                if len(self._vet_failed) > 1024:  # forget the oldest half
                    for old in sorted(self._vet_failed, key=self._vet_failed.get)[:512]:
                        del self._vet_failed[old]
            if exc.crashed:
                raise invalid(md_field, f"not NIXL metadata this server can read: {exc.why} "
                              "(in a helper process; nothing here changed)") from None
            raise RequestError(grpc.StatusCode.UNAVAILABLE,
                               f"{md_field}: {exc.why} (a helper process reads NIXL metadata "
                               "before the server does): try again") from None
        finally:
            with self._lock:
                self._vetting.discard(owner)
                self._vet_done.notify_all()
        with self._lock:
            agent = self._nixl()
            peer = self._peer_for(owner, name, metadata, name_field, md_field)  # as it is now
            if (None if peer is None else peer[3]) is not conn:
                # The agent came, went or reconnected meanwhile: what the helper read is not
                # what the engine's agent would.
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   f"{name_field}: agent {name!r} changed while its metadata "
                                   "was read: try again")
            if answer != "ok":  # NIXL raised in the helper: the engine's agent never reads it
                raise self._refused(answer, answer, peer, regions, name, name_field, md_field)
            # NIXL merges metadata of a known agent (a region's memory, or the whole agent
            # again): nothing is removed, so transfers of the agent's other regions go on.
            try:
                agent.add_remote_agent(metadata)
            except Exception as exc:  # nixlMismatchError and kin: not metadata of an agent
                kind = type(exc).__name__
                if kind != "nixlNotAllowedError" or peer is None:
                    raise self._refused(kind, f"{kind}: {exc}", peer, regions, name,
                                        name_field, md_field) from None
                # New connection info under a known name: the same caller's agent restarted
                # under that name. The old one is gone; its regions' memory with it.
                agent.remove_remote_agent(name)
                try:
                    agent.add_remote_agent(metadata)
                except Exception as again:
                    del self._peers[name]
                    raise _refusal(md_field, name, type(again).__name__,
                                   f"{type(again).__name__}: {again}") from None
                peer[3] = metadata
            if peer is None:
                peer = self._peers[name] = [owner, 0, 0.0, metadata]
            peer[1] += regions
            peer[2] = time.monotonic()
            self._evict_idle(owner)

    def _peer_for(self, owner: str, name: str, metadata: bytes, name_field: str,
                  md_field: str) -> list[Any] | None:
        """Under the lock: the known peer ``name`` (None if new), once the blob's header names
        that agent and the name is not another caller's (before NIXL sees the blob: it would
        merge it into the agent it names)."""
        named = metadata_agent(metadata)
        if named is None:
            raise invalid(md_field, "not NIXL agent metadata (no nixlSerDes agent header)")
        if named != name:
            raise invalid(name_field, f"{name!r}, but the metadata is agent {named!r}'s")
        peer = self._peers.get(name)
        if peer is not None and peer[0] != owner:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               f"{name_field}: agent {name!r} is registered by another "
                               "caller")
        return peer

    @staticmethod
    def _refused(kind: str, detail: str, peer: list[Any] | None, regions: int, name: str,
                 name_field: str, md_field: str) -> RequestError:
        """Why NIXL would not take the blob (it raised ``kind``), as the caller's status."""
        if kind == "nixlNotFoundError" and peer is None and not regions:
            return invalid(md_field, "no connection info: send the agent's "
                           "get_partial_agent_metadata([], inc_conn_info=True)")
        if kind == "nixlNotFoundError" and peer is None:
            # A region's own metadata names no connection: the agent must be known.
            return RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{name_field}: agent {name!r} is not connected to this server: "
                "ConnectNixl first (again after a server restart)")
        return _refusal(md_field, name, kind, detail)

    def drop_peer(self, name: str) -> None:
        """One region of peer ``name`` went. The agent stays known (connected) while idle, up
        to ``MAX_IDLE_PEERS`` per caller (the oldest idle ones go first)."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is None:
                return
            peer[1] -= 1
            peer[2] = time.monotonic()
            self._evict_idle(peer[0])

    def _evict_idle(self, owner: str) -> None:
        """Under the lock: forget ``owner``'s oldest agents without regions past the cap."""
        idle = sorted((p[2], n) for n, p in self._peers.items() if p[0] == owner and p[1] <= 0)
        for _, name in idle[:max(0, len(idle) - MAX_IDLE_PEERS)]:
            del self._peers[name]
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                log.exception("removing nixl agent %s failed", name)

    def close(self) -> None:
        """Engine shutdown: the metadata helper process goes."""
        self._vetter.close()

    def transports(self) -> list[ucx_choices.Choice]:
        """The transports UCX picked for this agent's transfers so far (its protocol tables:
        ``ucx_choices``); empty before the first transfer, or where the operator routes
        UCX's log."""
        with self._lock:
            return self._ucx.read()

    def knows(self, name: str) -> bool:
        with self._lock:
            return name in self._peers

    # ---- memory -------------------------------------------------------------------------

    def register(self, address: int, nbytes: int, memory: str = "DRAM", device: int = 0) -> Any:
        """Register local memory (a mirror) with the agent; returns what ``deregister`` takes."""
        with self._lock:
            return self._nixl().register_memory([(address, nbytes, device, "")], memory)

    def deregister(self, handle: Any) -> None:
        with self._lock:
            self._agent.deregister_memory(handle)

    # ---- transfers ----------------------------------------------------------------------

    def move(self, op: str, peer: str, local: Sequence[Span], remote: Sequence[Span],
             field: str, local_memory: str = "DRAM", remote_memory: str = "DRAM",
             timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        """``op`` "READ" (remote -> local) or "WRITE" (local -> remote) of matching spans, as
        one transfer, waited for. Raises RequestError naming ``field``: UNAVAILABLE when the
        peer cannot be reached or the transfer fails or times out, INVALID_ARGUMENT when NIXL
        refuses the descriptors (memory the client did not register)."""
        agent = self._agent
        t0 = time.perf_counter()
        try:
            ld = agent.get_xfer_descs(list(local), local_memory)
            rd = agent.get_xfer_descs(list(remote), remote_memory)
            handle = agent.initialize_xfer(op, ld, rd, peer)
        except Exception as exc:
            raise invalid(field, f"NIXL refused the transfer ({type(exc).__name__}): every "
                          "byte of a NIXL region must be memory registered with the client's "
                          "agent") from None
        try:
            state = agent.transfer(handle)
            polls, end = 0, time.monotonic() + timeout_s
            while state == "PROC":
                polls += 1
                if polls > _SPIN_POLLS:
                    if time.monotonic() > end:
                        raise _gone(field, f"the transfer took over {timeout_s:g} s")
                    time.sleep(50e-6)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise _gone(field, "the transfer failed (the client's agent is gone?)")
            if self._observe is not None:
                self._observe(DIRECTIONS[op], sum(n for _, n, _ in local),
                              time.perf_counter() - t0)
            if time.monotonic() - self._ucx_read_at > UCX_READ_S:  # new choices, warnings logged
                self._ucx_read_at = time.monotonic()
                self.transports()
        except RequestError:
            raise
        except Exception as exc:  # nixlRemoteDisconnectError: the client died or left
            raise _gone(field, f"the transfer failed ({type(exc).__name__}): the client's "
                        "agent cannot be reached") from None
        finally:
            try:
                agent.release_xfer_handle(handle)
            except Exception:  # still in flight after a timeout: NIXL keeps it
                log.warning("a nixl transfer handle could not be released")


def _gone(field: str, why: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE, f"{field}: NIXL: {why}")
