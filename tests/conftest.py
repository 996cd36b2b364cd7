"""Shared test set-up: the ``gpu`` and ``slow`` markers (declared in pyproject.toml), UCX
kept to loopback, and Triton's interpreter spared work that changes nothing."""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import pytest
import torch

# NIXL's UCX agents (tests' clients, servers, the metadata helper) on loopback only: an agent
# advertises every network interface it sees, and tests/deploy/test_netns_hosts.py makes and
# removes veth interfaces while other tests run. A peer's blob naming one that was gone took
# the server's metadata helper 16-20 s to read (a CI replica failed on its 20 s limit;
# reproduced on the dev box with the two test files side by side: 0.7 s with this set).
# Before any agent starts; inherited by the servers the tests start.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def _spare_the_interpreter() -> None:
    """Under TRITON_INTERPRET, three things Triton 3.6's interpreter redoes without need,
    which took ~46% of the kernel tests' time: the kernel tests 6:04 -> 3:17 of CPU with
    them spared (``pytest tests/kernels -n 2``, dev box, 2026-12-01). Kernel results are
    unchanged: every kernel test still compares with its float64 reference. Another Triton
    (without these internals) is left as it is."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    if not (hasattr(ti, "GridExecutor") and hasattr(ti.InterpretedFunction, "rewrite")
            and hasattr(ti, "_get_np_dtype") and hasattr(tl.core, "_type_for_tuple_values")):
        return
    _skip_repatching_in_launches(tl, ti)
    _memoized_np_dtypes(tl, ti)
    _lazy_tuple_types(tl.core)


def _skip_repatching_in_launches(tl: Any, ti: Any) -> None:
    """Triton patches ``triton.language`` for the interpreter at each kernel launch (and
    restores it after), and again at every call of a ``@triton.jit`` helper inside the
    kernel, never restored: the launch's patch is still in place then, so the helper's finds
    nothing left to patch, yet its ``inspect.getmembers`` walks cost ~0.26 ms a call. A
    decode test made 30K such calls: 7.8 of its 27 s (cProfile). Inside a launch, a helper
    whose language modules the launch patched is now called without patching them again."""
    patched: list[set[int]] = []  # the launches running now: their patched modules

    @functools.cache
    def langs(fn: object) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values()  # type: ignore[attr-defined]
                         if inspect.ismodule(v) and v in (tl, tl.core))

    launch = ti.GridExecutor.__call__
    helper = ti.InterpretedFunction.__call__

    def launch_once(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        patched.append(set(langs(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def call_helper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not patched:
            return helper(self, *args, **kwargs)
        mine = langs(self.fn)
        if not mine <= patched[-1]:
            # A module the launch left alone (``tl.core`` for Triton's own helpers, tl.zeros
            # and the like): patched by this call, and in place for the rest of the launch.
            patched[-1] |= mine
            return helper(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch_once
    ti.InterpretedFunction.__call__ = call_helper


def _memoized_np_dtypes(tl: Any, ti: Any) -> None:
    """The numpy dtype of a Triton type, looked up per operation (Triton builds a dict of 17
    entries each time: 1.6 of the same test's 27 s), is a pure function of the type."""
    np_dtype, memo = ti._get_np_dtype, {}

    def np_dtype_of(tt_dtype):  # noqa: ANN001, ANN202
        # A block's is its element's (a pointer's element is not: pointers are uint64).
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return memo[element]
        except KeyError:
            found = memo[element] = np_dtype(element)
            return found
        except TypeError:  # not hashable
            return np_dtype(tt_dtype)

    ti._get_np_dtype = np_dtype_of


def _lazy_tuple_types(core: Any) -> None:
    """Every interpreted tensor stores its shape as a ``tl.tuple``, whose type (a
    ``tuple_type`` with a name string built of its elements' reprs) Triton builds at once:
    60 of the 259 s of test_paged + test_features under cProfile (dev box, 2026-12-01), for
    types the interpreter rarely reads. Built on first read instead, from the same values."""
    tuple_type, tuple_ = core.tuple_type, core.tuple

    def type_init(self, types, fields=None):  # noqa: ANN001, ANN202
        self.types = types
        self.fields = fields or [""] * len(types)

    def type_name(self) -> str:  # noqa: ANN001
        pairs = zip(self.fields, self.types, strict=False)  # as Triton pairs them
        return "[" + ",".join(f"{k}:{v}" for k, v in pairs) + "]"

    def tuple_init(self, args, type=None):  # noqa: A002, ANN001, ANN202
        self.values = list(args)
        self.__dict__["_type_arg"] = type

    def get_type(self):  # noqa: ANN001, ANN202
        t = self.__dict__.get("_type")
        if t is None:
            arg = self.__dict__["_type_arg"]
            if isinstance(arg, tuple_type):
                t = arg
            elif arg is not None:  # a list or tuple of types
                t = tuple_type(arg)
            else:
                t = core._type_for_tuple_values(self.values)
            self.__dict__["_type"] = t
        return t

    def set_type(self, t):  # noqa: ANN001, ANN202
        self.__dict__["_type"] = t

    tuple_type.__init__ = type_init
    tuple_type.name = property(type_name)
    tuple_.__init__ = tuple_init
    tuple_.type = property(get_type, set_type)


_spare_the_interpreter()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    run_slow = os.environ.get("RUN_SLOW") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow; set RUN_SLOW=1"))
