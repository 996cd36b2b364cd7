"""decode (split-K flash-decoding) vs the float64 reference."""

from __future__ import annotations

import contextlib

import pytest
import torch

from attention_kernels import decode, decode_ref
from attention_kernels.configs import DECODE_TILE, DecodeConfig, decode_shape_config
from tests.kernels.conftest import (
    DEVICE,
    ON_GPU,
    TOL,
    check_lse,
    cu_seqlens,
    poison_,
    randn,
    rel_err,
)


def run_case(
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int = 0,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    batch, total = len(lens), sum(lens)
    cu = cu_seqlens(lens)
    q = randn(batch, heads, head_dim, dtype=dtype)
    k = randn(total, kv_heads, head_dim, dtype=dtype)
    v = randn(total, kv_heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    got, got_lse = decode(
        q, k, v, cu, num_splits=num_splits, return_lse=True, out=out, lse_out=lse,
        _config=config,
    )
    ref, ref_lse = decode_ref(q.double(), k.double(), v.double(), cu, return_lse=True)
    err = rel_err(got, ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]:.3g}"
    empty = torch.tensor(lens) == 0
    assert (got.cpu()[empty] == 0).all(), "empty sequences give zeros"
    check_lse(got_lse, ref_lse, dtype)
    return got, got_lse, (q, k, v, cu)


LENGTHS = [[1], [17], [127, 1], [0, 5, 0], [1000], [5, 300, 1, 64]]
if ON_GPU:
    LENGTHS += [[32768], [4096] * 16, [70000, 3, 0, 4096]]


@pytest.mark.parametrize("lens", LENGTHS, ids=lambda x: "-".join(map(str, x))[:40])
@pytest.mark.parametrize("num_splits", [0, 1, 3, 7], ids=lambda s: f"splits{s}")
def test_lengths_and_splits(lens: list[int], num_splits: int) -> None:
    run_case(lens, 8, 2, 64, torch.float16, num_splits)


@pytest.mark.parametrize("head_dim", [8, 40, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_head_dims_and_dtypes(head_dim: int, dtype: torch.dtype) -> None:
    run_case([33, 2], 4, 2, head_dim, dtype, num_splits=2)


# Query heads per kv head 1, 2 and 8, of 32 query heads on a GPU (where the kv heads also
# size the automatic split count); under the interpreter (splits from the length alone) of 8,
# as test_prefill's test_gqa: the same groups in a quarter of the programs (one per kv head).
GQA_HEADS = 32 if ON_GPU else 8


@pytest.mark.parametrize("group", [1, 2, 8], ids=["mha", "gqa2", "gqa8"])
def test_gqa(group: int) -> None:
    run_case([50, 7], GQA_HEADS, GQA_HEADS // group, 64, torch.bfloat16)


def test_explicit_splits_match_automatic() -> None:
    lens = [200, 31, 0, 97]
    got_auto, lse_auto, inputs = run_case(lens, 4, 1, 64, torch.float32, 0)
    q, k, v, cu = inputs
    for splits in (1, 2, 5, 16, 200):  # 200 > blocks per sequence: many empty splits
        got, lse = decode(q, k, v, cu, num_splits=splits, return_lse=True)
        # Splits change the summation order; on a GPU fp32 dots run in TF32.
        assert rel_err(got, got_auto) < (1e-3 if ON_GPU else 1e-5)
        check_lse(lse, lse_auto, torch.float16)


def test_block_shape_other_than_default() -> None:
    run_case([70, 33], 4, 2, 64, torch.float16, 3, config=DecodeConfig(32, 4, 1))


def test_strided_q() -> None:
    lens = [12, 30]
    cu = cu_seqlens(lens)
    q = randn(4, 2, 64, dtype=torch.float16)[::2]  # batch stride doubled
    k = randn(sum(lens), 2, 64, dtype=torch.float16)
    got = decode(q, k, k, cu)
    ref = decode_ref(q.double(), k.double(), k.double(), cu)
    assert rel_err(got, ref) < TOL[torch.float16]


def test_bad_inputs_raise() -> None:
    q = randn(2, 4, 64, dtype=torch.float16)
    k = randn(10, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="batch\\+1"):
        decode(q, k, k, cu_seqlens([10]))
    with pytest.raises(ValueError, match="num_splits"):
        decode(q, k, k, cu_seqlens([4, 6]), num_splits=-1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode(randn(2, 3, 64, dtype=torch.float16), k, k, cu_seqlens([4, 6]))


def test_fused_merge_is_deterministic_and_race_free() -> None:
    """The last split program of each (sequence, kv head) merges the partials the others
    wrote. The merge reads them in split order whichever program runs it, so repeated calls
    are bitwise equal. Before each call the blocks the partials will reuse are filled with NaN,
    so a partial read before it landed shows up (as NaN) instead of as last call's value."""
    lens = [8192, 3000] if ON_GPU else [300, 70]
    splits = 128 if ON_GPU else 5
    # GQA 4 as on a GPU; the interpreter runs 2 kv heads' programs, a quarter of 8's.
    heads, kv_heads, d = (32, 8, 128) if ON_GPU else (8, 2, 128)
    first, first_lse, (q, k, v, cu) = run_case(lens, heads, kv_heads, d, torch.bfloat16, splits)
    rows = len(lens) * heads * splits
    for _ in range(30 if ON_GPU else 2):
        # Same sizes and stream as decode's partial buffers: the caching allocator hands these
        # freed, NaN-filled blocks to the next call.
        junk = (torch.full((rows, d), float("nan"), device=DEVICE),
                torch.full((rows,), float("nan"), device=DEVICE))
        del junk
        out, lse = decode(q, k, v, cu, num_splits=splits, return_lse=True)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)


def test_shape_config_rule() -> None:
    """The measured points of ``decode_shape_config`` (132 SMs, an H100; D 128)."""
    sms, d = 132, 128
    assert decode_shape_config(DECODE_TILE, 512, 1, 8192, sms, d) == DecodeConfig(32, 4, 2)
    assert decode_shape_config(DECODE_TILE, 128, 1, 32768, sms, d) == DECODE_TILE  # 1 per SM
    # More than 4 per SM: 2 stages, 4 fit per SM.
    assert decode_shape_config(DECODE_TILE, 1024, 1, 2048, sms, d) == DecodeConfig(64, 4, 2)
    assert decode_shape_config(DECODE_TILE, 384, 1, 8192, sms, d) == DECODE_TILE  # 3 per SM fit
    # Splits of contiguous keys keep the default tile, long or short.
    assert decode_shape_config(DECODE_TILE, 8, 16, 512, sms, d) == DECODE_TILE
    assert decode_shape_config(DECODE_TILE, 8, 16, 256, sms, d) == DECODE_TILE
    assert decode_shape_config(DECODE_TILE, 8, 16, 2048, sms, d) == DECODE_TILE
    assert decode_shape_config(DECODE_TILE, 8, 16, 1024, sms, d) == DECODE_TILE
    assert decode_shape_config(DECODE_TILE, 512, 1, 8192, sms, 64) == DECODE_TILE  # unmeasured
    # One split at 3-4 per SM on a GPU of fast DRAM per SM (an H200's 4.8 TB/s over 132 SMs):
    # 64 keys in 2 warps; at an H100's 3.35 TB/s, the 32-key tile.
    h200, h100 = 4800.0, 3352.0
    assert decode_shape_config(DECODE_TILE, 512, 1, 8192, sms, d, gbps=h200) == DecodeConfig(
        64, 2, 2)
    assert decode_shape_config(DECODE_TILE, 512, 1, 8192, sms, d, gbps=h100) == DecodeConfig(
        32, 4, 2)
    for gbps in (0.0, h100, h200):  # the other rules do not look at the bandwidth
        assert decode_shape_config(DECODE_TILE, 1024, 1, 2048, sms, d,
                                   gbps=gbps) == DecodeConfig(64, 4, 2)
        assert decode_shape_config(DECODE_TILE, 384, 1, 8192, sms, d, gbps=gbps) == DECODE_TILE
        assert decode_shape_config(DECODE_TILE, 8, 16, 512, sms, d, gbps=gbps) == DECODE_TILE
    # Pages: the one-split rule in 64 keys of 2 warps on either GPU; splits of two 64-key
    # blocks in 2 stages, of three or four in 32-key blocks of 2 warps.
    for gbps in (0.0, h100, h200):
        assert decode_shape_config(DECODE_TILE, 512, 1, 8192, sms, d, paged=True,
                                   gbps=gbps) == DecodeConfig(64, 2, 2)
    # ... in 64-key blocks of 4 warps where pages are smaller than 32 tokens.
    for page_tokens, tile in ((16, DecodeConfig(64, 4, 2)), (31, DecodeConfig(64, 4, 2)),
                              (32, DecodeConfig(64, 2, 2)), (64, DecodeConfig(64, 2, 2))):
        assert decode_shape_config(DECODE_TILE, 512, 1, 8192, sms, d, paged=True,
                                   page_tokens=page_tokens) == tile
    assert decode_shape_config(DECODE_TILE, 512, 1, 8192, sms, d,
                               page_tokens=16) == DecodeConfig(32, 4, 2)  # contiguous keys
    # More than 4 per SM on pages: 2 warps (H200, 128 x 2K).
    assert decode_shape_config(DECODE_TILE, 1024, 1, 2048, sms, d, paged=True) == DecodeConfig(
        64, 2, 2)
    assert decode_shape_config(DECODE_TILE, 8, 16, 512, sms, d, paged=True) == DECODE_TILE
    assert decode_shape_config(DECODE_TILE, 8, 32, 128, sms, d, paged=True) == DecodeConfig(
        64, 4, 2)
    for split_len in (129, 256):
        assert decode_shape_config(DECODE_TILE, 8, 32, split_len, sms, d,
                                   paged=True) == DecodeConfig(32, 2, 3)
    assert decode_shape_config(DECODE_TILE, 8, 32, 257, sms, d, paged=True) == DECODE_TILE
    other = DecodeConfig(32, 4, 3)  # fp32 / D 256: not the rule's to change
    assert decode_shape_config(other, 512, 1, 8192, sms, d) is other


@pytest.mark.parametrize(("lens", "splits", "gbps", "tile"), [
    ([300] * 7, 1, 0.0, (32, 4)),  # 14 programs, one split: 3-4 per SM of the 4 SMs faked
    ([300] * 7, 1, 100.0, (32, 4)),  # 25 GB/s per SM (an H100's): the same
    ([300] * 7, 1, 146.0, (64, 2)),  # 36.5 GB/s per SM (an H200's): 64 keys in 2 warps
    ([1100], 2, 146.0, (64, 4)),  # splits of 550 keys: the default tile (cold keys: 128 lost)
    ([300] * 2, 1, 146.0, (64, 4)),  # 4 programs: the default tile
])
def test_shape_rule_is_applied(monkeypatch: pytest.MonkeyPatch, lens: list[int], splits: int,
                               gbps: float, tile: tuple[int, int]) -> None:
    """decode's plan takes the rule's tile when no config is given (here on a faked 4-SM
    Hopper of ``gbps`` DRAM GB/s), and the answer still matches the reference."""
    from attention_kernels import decode_kernel

    monkeypatch.setattr(decode_kernel, "decode_config", lambda *a, **k: DECODE_TILE)
    monkeypatch.setattr(decode_kernel, "_shape_rule_sms", lambda device: 4)
    monkeypatch.setattr(decode_kernel, "_dram_gbps", lambda device: gbps)
    decode_kernel._PLANS.clear()
    try:
        run_case(lens, 4, 2, 128, torch.bfloat16, splits)
        (plan,) = decode_kernel._PLANS._plans.values()
        kwargs = plan.launch.kwargs
        assert (kwargs["BLOCK_N"], kwargs["num_warps"]) == tile
    finally:
        decode_kernel._PLANS.clear()


@pytest.mark.parametrize("config", [DecodeConfig(32, 4, 2), DecodeConfig(64, 2, 2),
                                    DecodeConfig(64, 2, 3), DecodeConfig(128, 4, 3)],
                         ids=lambda c: f"{c.block_n}x{c.num_warps}x{c.num_stages}")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_shape_config_tiles(config: DecodeConfig, num_splits: int) -> None:
    """The tiles the shape rule picks, on lengths that are not multiples of them."""
    run_case([700, 3, 0, 129], 8, 2, 64, torch.bfloat16, num_splits, config)
    run_case([300, 1], 4, 4, 80, torch.float16, num_splits, config)


MERGE_MODES = ["fused", "separate", "pdl"] if ON_GPU else ["fused", "separate"]


@pytest.mark.parametrize("mode", MERGE_MODES)
@pytest.mark.parametrize("tile", [256, 512, 700, 8192], ids=lambda t: f"tile{t}")
def test_merge_modes_and_tiles(monkeypatch: pytest.MonkeyPatch, mode: str, tile: int) -> None:
    """The ways of merging the split partials (PDL on a GPU only), with merge steps of 1, 2
    and all splits (tile 256 / 512 at 4 heads x D 64: one / two of the 7 splits per step, the
    last step partial; 700 rounds down to 2), on lengths with empty splits and empty
    sequences."""
    from attention_kernels import decode_kernel

    monkeypatch.setattr(decode_kernel, "MERGE_MODE", mode)
    monkeypatch.setattr(decode_kernel, "MERGE_TILE_ELEMS", tile)
    monkeypatch.setattr(decode_kernel, "MERGE_KERNEL_TILE_ELEMS", tile)
    decode_kernel._PLANS.clear()
    try:
        for lens in ([300, 70], [0, 5, 130], [64]):
            run_case(lens, 8, 2, 64, torch.bfloat16, 7)
    finally:
        decode_kernel._PLANS.clear()


def test_split_counters_are_zero_after_every_call() -> None:
    """The last program of each group resets its counter, so the per-stream buffer can be
    reused without a memset, whatever the next call's split count or batch. (Meaningful on a
    GPU; the interpreter runs programs one after another.)"""
    from attention_kernels import decode_kernel

    decode_kernel._COUNTERS.clear()
    for lens, splits in (([300, 70], 7), ([5, 9, 200], 3), ([64], 2), ([300, 70], 5)):
        run_case(lens, 8, 2, 64, torch.float16, splits)
        assert decode_kernel._COUNTERS, "the split path uses the counter buffers"
        for buf in decode_kernel._COUNTERS.values():
            assert int(buf.count_nonzero()) == 0


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA streams")
def test_concurrent_streams_keep_their_own_counters() -> None:
    """Split decodes on two streams that really overlap (each stream first sleeps ~25 ms on
    the GPU, so both queues fill before either runs) equal the same calls made one at a time.
    Sharing one counter buffer across the streams fails this (measured: 172 of 300 wrong)."""
    cases = []
    for seed in range(6):
        g = torch.Generator(device="cpu").manual_seed(seed)
        lens = [int(x) for x in torch.randint(20_000, 60_000, (2,), generator=g)]
        q = torch.randn(2, 32, 128, generator=g).to(DEVICE, torch.bfloat16)
        k = torch.randn(sum(lens), 8, 128, generator=g).to(DEVICE, torch.bfloat16)
        v = torch.randn(sum(lens), 8, 128, generator=g).to(DEVICE, torch.bfloat16)
        cases.append((q, k, v, cu_seqlens(lens).to(DEVICE)))
    expected = [decode(*c, num_splits=16) for c in cases]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)
    got = []
    for rep in range(10):
        for i, c in enumerate(cases):
            with torch.cuda.stream(streams[(i + rep) % 2]):
                got.append((i, decode(*c, num_splits=16)))
    torch.cuda.synchronize()
    assert sum(not torch.equal(out, expected[i]) for i, out in got) == 0


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA graphs")
def test_cuda_graph_replays_zero_their_own_counters() -> None:
    """A captured split decode owns its counters (zeroed inside the graph): replays match
    eager calls, also when eager calls on the same stream run in between."""
    bf16 = torch.bfloat16
    q, k, v = (randn(1, 32, 128, dtype=bf16), randn(5000, 8, 128, dtype=bf16),
               randn(5000, 8, 128, dtype=bf16))
    cu = cu_seqlens([5000])
    expected = decode(q, k, v, cu, num_splits=16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode(q, k, v, cu, num_splits=16)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode(q, k, v, cu, num_splits=16)
    for _ in range(5):
        captured.fill_(float("nan"))
        graph.replay()
        eager = decode(q, k, v, cu, num_splits=16)
        torch.cuda.synchronize()
        assert torch.equal(captured, expected) and torch.equal(eager, expected)


def test_for_cuda_graphs_scopes_the_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MERGE_MODE`` "auto" takes the PDL merge (on Hopper) inside ``for_cuda_graphs()`` only:
    not after an exception leaves it, and not in another thread meanwhile (the engine's
    threads launch eagerly while one captures). Decodes inside it match the reference (the
    fused merge elsewhere than Hopper; the PDL merge, eagerly, on Hopper)."""
    import threading

    from attention_kernels import decode_kernel, for_cuda_graphs

    device = torch.device("cuda", 0)
    monkeypatch.setattr(decode_kernel, "_hopper", lambda d: True)
    assert decode_kernel._merge_mode(device) == "fused"
    seen: list[str] = []
    with pytest.raises(RuntimeError), for_cuda_graphs():
        assert decode_kernel._merge_mode(device) == "pdl"
        other = threading.Thread(target=lambda: seen.append(decode_kernel._merge_mode(device)))
        other.start()
        other.join()
        raise RuntimeError
    assert seen == ["fused"]
    assert decode_kernel._merge_mode(device) == "fused"
    monkeypatch.setattr(decode_kernel, "MERGE_MODE", "pdl")  # forced, where there is no PDL
    monkeypatch.setattr(decode_kernel, "_hopper", lambda d: False)
    assert decode_kernel._merge_mode(device) == "separate"
    monkeypatch.undo()
    with for_cuda_graphs():  # elsewhere than Hopper: the same fused merge, the same answers
        if not ON_GPU or torch.cuda.get_device_capability()[0] != 9:
            assert decode_kernel._merge_mode(torch.device(DEVICE)) == "fused"
        run_case([300, 0, 70], 8, 2, 64, torch.bfloat16, 7)


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA graphs")
def test_graphs_take_the_pdl_merge_on_hopper() -> None:
    """A plain capture keeps the fused merge; calls under ``for_cuda_graphs()`` (eager first,
    then captured) take the PDL merge kernel on Hopper. Replays are bitwise equal to the eager
    call of the same scope, before and after."""
    from attention_kernels import decode_kernel, for_cuda_graphs

    bf16 = torch.bfloat16
    q, k, v = (randn(1, 32, 128, dtype=bf16), randn(4096, 8, 128, dtype=bf16),
               randn(4096, 8, 128, dtype=bf16))
    cu = cu_seqlens([4096])
    hopper = torch.cuda.get_device_capability()[0] >= 9
    for scoped in (False, True):
        decode_kernel._PLANS.clear()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with for_cuda_graphs() if scoped else contextlib.nullcontext():
            with torch.cuda.stream(stream):
                expected = decode(q, k, v, cu, num_splits=16)  # compiles outside the capture
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                captured = decode(q, k, v, cu, num_splits=16)
        (plan,) = decode_kernel._PLANS._plans.values()
        if scoped and hopper:
            assert plan.merge is not None and plan.merge.kwargs["launch_pdl"]
        else:
            assert plan.merge is None, "the split kernel merges"
        for _ in range(3):
            captured.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, expected)
        with for_cuda_graphs() if scoped else contextlib.nullcontext():
            again = decode(q, k, v, cu, num_splits=16)
        assert torch.equal(again, expected)


@pytest.mark.skipif(not ON_GPU, reason="compiled variants exist on a GPU only")
def test_warmup_compiles_what_decode_serves() -> None:
    """After ``warmup`` at D 128, decodes of other batch sizes, lengths, split counts and GQA
    ratios 4 and 8 (the shape rule's tiles included) compile nothing new, eagerly or for CUDA
    graphs (``for_cuda_graphs``: the PDL merge on Hopper): a server's first request of a new
    shape does not stall on a compile."""
    from attention_kernels import decode_kernel, for_cuda_graphs, warmup

    def variants() -> int:
        kernels = (decode_kernel._decode_split_kernel, decode_kernel._decode_merge_kernel)
        return sum(len(c[0]) for kernel in kernels for c in kernel.device_caches.values())

    warmup((128,), (torch.bfloat16,), DEVICE)
    before = variants()
    for batch, ctx, heads, kv_heads in ((1, 4096, 32, 8), (2, 4096, 32, 8), (1, 8192, 32, 8),
                                        (64, 8192, 32, 8), (3, 1000, 16, 2), (5, 300, 64, 8),
                                        (80, 300, 32, 8)):
        lens = [ctx] * batch
        q = randn(batch, heads, 128, dtype=torch.bfloat16)
        k = randn(batch * ctx, kv_heads, 128, dtype=torch.bfloat16)
        cu = cu_seqlens(lens)
        for lse in (False, True):
            decode(q, k, k, cu, max_seqlen_k=ctx, return_lse=lse)
            with for_cuda_graphs():
                decode(q, k, k, cu, max_seqlen_k=ctx, return_lse=lse)
    assert variants() == before
