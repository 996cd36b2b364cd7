"""Which UCX transport moves a NIXL peer's bytes: read from UCX's own protocol tables.

NIXL does not say which transport UCX picked for a peer (cuda_ipc, rc_mlx5, tcp, cma...),
and a silent fallback (GPU memory over TCP at 0.4 GB/s, issue 66) looks like a slow network.
With ``UCX_PROTO_INFO=y`` UCX prints a table each time it selects protocols for an endpoint
configuration and operation, e.g. (H200, a GPU region of a client on the same host)::

    | attention-server-7103-0a633f69 intra-node cfg#2                       |
    | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
    | Range  | Description |              Config                            |
    | 0..inf | zero-copy   | cuda_ipc/cuda                                  |

``loading`` points those tables at a log file of this process (``UCX_LOG_FILE``) while UCX
loads, unless the operator set either variable; ``UcxChoices.read`` takes the tables of one
agent added since, and passes UCX's warnings and errors on to the server's log. UCX reads
the variables once per process, when it loads: the first agent's start decides.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

log = logging.getLogger("attention_service")

_PREFIX = re.compile(r"^\[[^\]]*\] \[[^\]]*\]\s*")  # "[time] [host:pid:thread]"
_CONFIG = re.compile(r"^\|\s*(\S+)\s+(.+?)\s+cfg#\d+\s*\|$")  # "| <agent> intra-node cfg#1 |"
# NIXL's transfers: UCX marks their tables "(multi)" (seen with the UCX 1.23 of nixl-cu13
# 1.5.1); the tables without it are selections UCX makes ahead when an endpoint is made (e.g. a
# put from host memory to GPU memory by TCP emulation, which none of our transfers does).
# Memory: "host memory", "cuda/GPU0" (here), "cuda/dev[1]" (the peer's).
_OPERATION = re.compile(
    r"^\|\s*remote memory (read|write) by ucp_\w+\*\(multi\) (?:into|from) (\w+)\S*(?: memory)? "
    r"(?:from|to) (\w+)")
_TRANSPORT = re.compile(r"([a-z][a-z0-9_]*)/\S")  # "cuda_ipc/cuda", "rc_mlx5/mlx5_0:1"
_PROBLEM = re.compile(r"\b(WARN|ERROR)\b")
try:  # UCX writes its log through a buffered stdio stream: fflush(NULL) flushes every one
    _flush_all = ctypes.CDLL(None).fflush
except (OSError, AttributeError):  # not glibc: a table shows once 4 KiB of log are buffered
    _flush_all = None

# One choice: (where the peer is: "intra-node" or "inter-node"; "read" or "write"; the local
# memory, the remote memory: "host" or "cuda"; the transport): NixlTransport's fields, in
# their order (the metric's labels are those names too).
Choice = tuple[str, str, str, str, str]


class UcxChoices:
    """Agent ``agent``'s protocol tables in its process's UCX log file, read as it grows."""

    def __init__(self, path: str | None, agent: str) -> None:
        self.path = path  # None: not ours to read (the operator routes UCX's output)
        self.agent = agent
        self._offset = 0
        self._partial = ""
        self._scope = ""
        self._operation: tuple[str, ...] | None = None
        self._choices: dict[Choice, None] = {}  # in the order seen

    def read(self) -> list[Choice]:
        """Every choice seen so far (new ones logged once)."""
        if self.path is None:
            return []
        if _flush_all is not None:
            _flush_all(None)
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:  # UCX writes nothing until it has something to say
            return list(self._choices)
        self._offset += len(data)
        lines = (self._partial + data.decode("utf-8", errors="replace")).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._line(line)
        return list(self._choices)

    def _line(self, line: str) -> None:
        body = _PREFIX.sub("", line).strip()
        if not body.startswith(("|", "+")):
            if _PROBLEM.search(line):
                log.warning("ucx: %s", body)
            return
        if (m := _CONFIG.match(body)) is not None:
            # Another agent's (a client's in the same process) or its own loopback: skipped.
            ours = m.group(1) == self.agent and m.group(2) != "self"
            self._scope, self._operation = (m.group(2) if ours else ""), None
        elif (m := _OPERATION.match(body)) is not None:
            self._operation = m.groups()
        elif body.startswith("|") and self._scope and self._operation is not None:
            config = body.rstrip("|").rsplit("|", 1)[-1]
            for transport in _TRANSPORT.findall(config):
                choice = (self._scope, *self._operation, transport)
                if choice not in self._choices:
                    self._choices[choice] = None
                    log.info("nixl: UCX %ss between %s memory here and %s memory of %s "
                             "peers by %s", choice[1], choice[2], choice[3], choice[0], transport)


@contextlib.contextmanager
def loading(agent: str) -> Iterator[UcxChoices]:
    """Around the making of agent ``agent`` (UCX loads then): UCX's protocol tables into a
    log file of this process (chosen once per process), unless the operator set
    ``UCX_PROTO_INFO`` or ``UCX_LOG_FILE`` (then nothing is read); the agent's choices from
    it. The variables are set only meanwhile: processes started later (the metadata helper,
    or servers a test starts) see the operator's environment."""
    path = _log_file()
    saved = {key: os.environ.get(key) for key in _VARIABLES}
    if path is not None:
        os.environ.update(zip(_VARIABLES, ("y", path), strict=True))
    try:
        yield UcxChoices(path, agent)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_VARIABLES = ("UCX_PROTO_INFO", "UCX_LOG_FILE")


@functools.cache
def _log_file() -> str | None:
    if any(key in os.environ for key in _VARIABLES):
        return None
    folder = tempfile.mkdtemp(prefix="attention-ucx-")
    atexit.register(shutil.rmtree, folder, True)
    return os.path.join(folder, "ucx.log")
