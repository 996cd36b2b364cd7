"""Request preparation: tensor codec (numpy, ml_dtypes, torch), shapes, headers, validation."""

from __future__ import annotations

import numpy as np
import pytest

from attention_client._decode import prepare_decode
from attention_client._prefill import prepare_prefill
from attention_client._requests import ScoreMods
from attention_client._tensors import as_cu_seqlens, result_flavour, to_user, to_wire
from attention_wire.pb import attention_pb2 as pb

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")

RNG = np.random.default_rng(0)


def _np(*shape, dtype=np.float16):
    return RNG.standard_normal(shape).astype(dtype)


def _header(prep, cls=pb.PrefillHeader):
    return cls.FromString(prep.header)


@pytest.mark.parametrize(
    ("dtype", "wire"),
    [(np.float16, pb.FLOAT16), (np.float32, pb.FLOAT32), (ml_dtypes.bfloat16, pb.BFLOAT16)],
)
def test_numpy_codec_round_trip(dtype, wire):
    x = _np(5, 2, 8, dtype=dtype)
    w = to_wire(x, "q")
    assert w.dtype == wire and w.shape == (5, 2, 8)
    assert bytes(w.byte_view()) == x.tobytes()
    assert np.shares_memory(w.array, x), "contiguous input must not be copied"
    back = to_user(w.array.copy(), *result_flavour(x))
    assert back.dtype == x.dtype and np.array_equal(back.view(np.uint8), x.view(np.uint8))


def test_numpy_non_contiguous_and_big_endian():
    x = _np(8, 2, 16, dtype=np.float32)[::2, :, ::2]
    w = to_wire(x, "q")
    assert w.array.flags.c_contiguous and bytes(w.byte_view()) == np.ascontiguousarray(x).tobytes()
    be = x.astype(">f4")
    w = to_wire(be, "k")
    assert w.array.dtype == np.dtype("<f4") and np.array_equal(w.array, x)
    assert result_flavour(be) == (np.dtype("<f4"), None)  # results come back little-endian


@pytest.mark.parametrize(
    ("dtype", "wire"),
    [(torch.float16, pb.FLOAT16), (torch.float32, pb.FLOAT32), (torch.bfloat16, pb.BFLOAT16)],
)
def test_torch_codec_round_trip(dtype, wire):
    x = torch.randn(6, 3, 8, requires_grad=True).to(dtype)
    w = to_wire(x, "q")
    assert w.dtype == wire
    ref = x.detach().view(torch.int16 if dtype == torch.bfloat16 else dtype).numpy().tobytes()
    assert bytes(w.byte_view()) == ref
    back = to_user(w.array.copy(), *result_flavour(x))
    assert isinstance(back, torch.Tensor) and back.dtype == dtype and torch.equal(back, x.detach())


def test_torch_non_contiguous():
    x = torch.randn(4, 8, 16).to(torch.bfloat16).transpose(0, 1)
    w = to_wire(x, "q")
    assert w.shape == (8, 4, 16)
    assert bytes(w.byte_view()) == x.contiguous().view(torch.int16).numpy().tobytes()


def test_bf16_wire_bits_match_between_numpy_and_torch():
    t = torch.randn(4, 2, 8).to(torch.bfloat16)
    n = t.float().numpy().astype(ml_dtypes.bfloat16)
    assert bytes(to_wire(t, "q").byte_view()) == bytes(to_wire(n, "q").byte_view())


@pytest.mark.parametrize(
    "bad",
    [np.zeros((2, 1, 8), np.float64), np.zeros((2, 1, 8), np.int32), torch.zeros(2, 1, 8).double()],
)
def test_unsupported_dtype_names_the_field(bad):
    q = _np(2, 1, 8)
    with pytest.raises(ValueError, match="^k has unsupported dtype"):
        prepare_prefill(q, bad, q)


def test_not_an_array():
    with pytest.raises(ValueError, match="v must be a numpy array or a torch tensor"):
        prepare_prefill(_np(2, 1, 8), _np(2, 1, 8), [[1.0]])


def test_mismatched_dtypes():
    with pytest.raises(ValueError, match="share one dtype.*FLOAT16, FLOAT32, FLOAT16"):
        prepare_prefill(_np(2, 1, 8), _np(2, 1, 8, dtype=np.float32), _np(2, 1, 8))


def test_kv_shape_mismatch():
    with pytest.raises(ValueError, match="v shape .* differs from k"):
        prepare_prefill(_np(2, 1, 8), _np(3, 1, 8), _np(2, 1, 8))


@pytest.mark.parametrize("shape", [(8,), (2, 8), (1, 1, 2, 1, 8)])
def test_wrong_rank_of_q(shape):
    x = _np(*shape)
    with pytest.raises(ValueError, match="^q must be 3-D"):
        prepare_prefill(x, x, x)


def test_wrong_rank_of_k_and_batch_mismatch():
    with pytest.raises(ValueError, match="^k must be 4-D"):
        prepare_prefill(_np(2, 3, 1, 8), _np(6, 1, 8), _np(6, 1, 8))
    with pytest.raises(ValueError, match="k batch 3 differs from q batch 2"):
        prepare_prefill(_np(2, 3, 1, 8), _np(3, 3, 1, 8), _np(3, 3, 1, 8))
    with pytest.raises(ValueError, match="^q must be 3-D packed"):
        prepare_prefill(_np(2, 3, 1, 8), _np(2, 3, 1, 8), _np(2, 3, 1, 8), [0, 3, 6])


def test_dense_3d_header():
    prep = prepare_prefill(_np(5, 4, 8), _np(7, 2, 8), _np(7, 2, 8), causal=True,
                           softmax_scale=0.5, return_lse=True)
    h = _header(prep)
    assert list(h.cu_seqlens_q) == [0, 5] and list(h.cu_seqlens_k) == [0, 7]
    assert h.causal and h.return_lse and h.HasField("softmax_scale") and h.softmax_scale == 0.5
    assert list(h.k.shape) == [7, 2, 8] and h.q.dtype == pb.FLOAT16
    assert prep.out_shape == (5, 4, 8) and prep.lse_shape == (4, 5)


def test_dense_4d_packs_without_copy_and_reshapes_lse():
    q, k = _np(3, 5, 4, 8), _np(3, 7, 2, 8)
    prep = prepare_prefill(q, k, k, return_lse=True)
    h = _header(prep)
    assert list(h.cu_seqlens_q) == [0, 5, 10, 15] and list(h.cu_seqlens_k) == [0, 7, 14, 21]
    assert list(h.q.shape) == [15, 4, 8] and list(h.v.shape) == [21, 2, 8]
    assert not h.HasField("softmax_scale")
    assert np.shares_memory(prep.tensors[0].array, q)
    lse = np.arange(4 * 15, dtype=np.float32).reshape(4, 15)
    out, lse_b = prep.result(q.reshape(15, 4, 8).copy(), lse)
    assert out.shape == (3, 5, 4, 8) and lse_b.shape == (3, 4, 5)
    assert lse_b.flags.c_contiguous
    for b in range(3):
        assert np.array_equal(lse_b[b], lse[:, b * 5 : (b + 1) * 5])


def test_varlen_header_and_cu_seqlens_types():
    q, k = _np(6, 2, 8), _np(9, 2, 8)
    for cu_q, cu_k in [
        ([0, 2, 6], [0, 4, 9]),
        (np.array([0, 2, 6], np.int64), np.array([0, 4, 9], np.uint32)),
        (torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 4, 9])),
    ]:
        h = _header(prepare_prefill(q, k, k, cu_q, cu_k))
        assert list(h.cu_seqlens_q) == [0, 2, 6] and list(h.cu_seqlens_k) == [0, 4, 9]
    h = _header(prepare_prefill(q, q, q, [0, 6]))
    assert list(h.cu_seqlens_k) == []  # empty: the server reuses cu_seqlens_q


def test_cu_seqlens_validation():
    q = _np(6, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens_k needs cu_seqlens"):
        prepare_prefill(q, q, q, None, [0, 6])
    with pytest.raises(ValueError, match="cu_seqlens must hold integers"):
        prepare_prefill(q, q, q, [0.0, 6.0])
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        prepare_prefill(q, q, q, [[0, 6]])
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        prepare_prefill(q, q, q, [])
    with pytest.raises(ValueError, match="fit in int32"):
        as_cu_seqlens([0, 2**31], "cu_seqlens")
    with pytest.raises(ValueError, match="cu_seqlens has 1 sequences but cu_seqlens_k has 2"):
        prepare_prefill(q, q, q, [0, 6], [0, 3, 6])


def test_softmax_scale_must_be_finite():
    q = _np(2, 1, 8)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        prepare_prefill(q, q, q, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        prepare_decode(q, q, q, [0, 1, 2], softmax_scale=float("inf"))


@pytest.mark.parametrize("bad", ["0.5", b"0.5", bytearray(b"0.5"), memoryview(b"0.5"), True,
                                 np.True_, np.array(True), np.array([0.5]), 1 + 2j])
def test_softmax_scale_must_be_a_number(bad):
    q = _np(2, 1, 8)
    with pytest.raises(ValueError, match="softmax_scale must be a real number"):
        prepare_prefill(q, q, q, softmax_scale=bad)


def test_softmax_scale_takes_numpy_and_0d_tensor_numbers():
    torch = pytest.importorskip("torch")
    q = _np(2, 1, 8)
    for scale in (np.float32(0.25), np.int64(2), np.array(0.5), torch.tensor(0.25),
                  torch.tensor(3), 1):
        h = pb.PrefillHeader.FromString(prepare_prefill(q, q, q, softmax_scale=scale).header)
        assert h.softmax_scale == float(scale)
    for bad in (torch.tensor(True), torch.tensor([0.5])):
        with pytest.raises(ValueError, match="softmax_scale must be a real number"):
            prepare_prefill(q, q, q, softmax_scale=bad)


@pytest.mark.parametrize("bad", ["no", "", None, 2, -1, 0.0, [True]])
def test_flags_must_be_bools(bad):
    """``bool("no")`` is True: a flag takes True/False (numpy's too) or 0/1, nothing else."""
    q = _np(2, 1, 8)
    with pytest.raises(ValueError, match="causal must be a bool"):
        prepare_prefill(q, q, q, causal=bad)
    with pytest.raises(ValueError, match="return_lse must be a bool"):
        prepare_decode(q, q, q, [0, 1, 2], return_lse=bad)


def test_flags_take_bools_and_0_1():
    q = _np(2, 1, 8)
    for flag, want in ((True, True), (np.False_, False), (1, True), (np.int64(0), False)):
        h = pb.PrefillHeader.FromString(prepare_prefill(q, q, q, causal=flag).header)
        assert h.causal is want


@pytest.mark.parametrize("bad", ["1.5", True, b"1"])
def test_softcap_must_be_a_number(bad):
    with pytest.raises(ValueError, match="softcap must be a number"):
        ScoreMods.of((-1, -1), bad, None)


@pytest.mark.parametrize("bad", [True, False, "2", 2.0])
def test_num_splits_must_be_an_int(bad):
    q = _np(2, 1, 8)
    with pytest.raises(ValueError, match="num_splits must be an int"):
        prepare_decode(q, q, q, [0, 1, 2], num_splits=bad)


def test_decode_header_and_validation():
    q, k = _np(3, 4, 8), _np(10, 2, 8)
    prep = prepare_decode(q, k, k, [0, 2, 5, 10], num_splits=4, return_lse=True)
    h = _header(prep, pb.DecodeHeader)
    assert list(h.cu_seqlens_k) == [0, 2, 5, 10] and h.num_splits == 4 and h.return_lse
    assert prep.out_shape == (3, 4, 8) and prep.lse_shape == (3, 4)
    with pytest.raises(ValueError, match="batch\\+1 = 4 entries"):
        prepare_decode(q, k, k, [0, 10])
    with pytest.raises(ValueError, match="^q must be 3-D"):
        prepare_decode(_np(1, 3, 4, 8), k, k, [0, 10])
    with pytest.raises(ValueError, match="num_splits"):
        prepare_decode(q, k, k, [0, 2, 5, 10], num_splits=-1)
    with pytest.raises(ValueError, match="cu_seqlens_k is required"):
        prepare_decode(q, k, k, None)
