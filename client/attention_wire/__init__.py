"""What the client and the server share about the wire: the generated stubs (``pb``), the
hand-written codec of the tensor-carrying messages, requests and responses in both directions
(``messages``), a first-fit allocator of shared-memory byte ranges (``alloc``), and the rules
for same-host shared-memory regions (``shm``, ``cuda_ipc``).

It ships with the client distribution (``pip install ./client``), so the client still installs
alone; the server depends on this package, never on the client's private modules.
"""

__version__ = "0.1.0"


def unary_method(rpc: str) -> str:
    """The unary twin of a compute rpc (the whole request and the whole answer in one message
    each): ``CacheDecode`` -> ``CacheDecodeUnary``."""
    return f"{rpc}Unary"
