"""local_comm: the CPU implementation's values and the dispatch to torch.cuda.comm.

The CUDA branch cannot run here; ``scripts/gpu_check.py`` compares it with the CPU branch on a
GPU machine. What runs here: every CPU result against plain torch, the documented summation
order bit for bit, torch's chunking rules, version counters, and — with torch.cuda.comm
replaced by a recorder — that all-CUDA device lists go to torch.cuda.comm with the arguments it
expects.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_ddp.transport import local_comm

CPU3 = ["cpu", "cpu", "cpu"]


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g), torch.arange(5, dtype=torch.int64),
            torch.randn(7, generator=g, dtype=torch.float64), torch.randn(2, 2, 2, generator=g),
            torch.randn(6, generator=g).as_strided((2, 2), (1, 3))]  # non-contiguous


@pytest.mark.parametrize("buffer_size", [1, 40, local_comm.DEFAULT_BUFFER_SIZE])
def test_broadcast_coalesced_copies_every_tensor_in_order(buffer_size):
    tensors = _tensors()
    out = local_comm.broadcast_coalesced(tensors, CPU3, buffer_size=buffer_size)
    assert len(out) == 3
    assert all(a is b for a, b in zip(out[0], tensors, strict=True))  # device 0: the inputs
    for copies in out[1:]:
        for copy, original in zip(copies, tensors, strict=True):
            assert torch.equal(copy, original) and copy.dtype == original.dtype
            assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    # Each copy has its own version counter (torch re-wraps the unflattened views).
    before = out[2][1]._version
    out[2][0].add_(1)
    assert out[2][1]._version == before
    assert not torch.equal(out[1][0], out[2][0])  # and its own memory per device


def test_reduce_add_coalesced_sums_in_list_order_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    per_device = [[torch.randn(50, generator=g) * 10 ** i, torch.randn(3, 3, generator=g,
                                                                      dtype=torch.float64),
                   torch.arange(4) * i] for i in range(4)]
    out = local_comm.reduce_add_coalesced(per_device, "cpu", buffer_size=64)
    for position in range(3):
        expected = per_device[0][position] + per_device[1][position]
        expected = (expected + per_device[2][position]) + per_device[3][position]
        assert torch.equal(out[position], expected)
        assert out[position].dtype == per_device[0][position].dtype
    # One device: the sum is a copy of its tensors.
    single = local_comm.reduce_add_coalesced(per_device[:1], "cpu")
    assert all(torch.equal(a, b) for a, b in zip(single, per_device[0], strict=True))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=5), st.integers(1, 5),
       st.integers(1, 400))
def test_reduce_add_does_not_depend_on_the_buffer_size(sizes, devices, buffer_size):
    g = torch.Generator().manual_seed(sum(sizes) + devices)
    per_device = [[torch.randn(s, generator=g) for s in sizes] for _ in range(devices)]
    small = local_comm.reduce_add_coalesced(per_device, "cpu", buffer_size=buffer_size)
    large = local_comm.reduce_add_coalesced(per_device, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(small, large, strict=True))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.integers(0, 1))
def test_scatter_follows_torch_chunk_and_gather_inverts_it(length, parts, dim):
    shape = [3, 3]
    shape[dim] = length
    tensor = torch.randn(*shape)
    chunks = local_comm.scatter(tensor, ["cpu"] * parts, dim=dim)
    expected = tensor.chunk(parts, dim)
    assert [c.shape for c in chunks] == [c.shape for c in expected]  # may be fewer than parts
    assert local_comm.default_chunk_sizes(length, parts) == [c.size(dim) for c in expected]
    assert torch.equal(local_comm.gather(chunks, "cpu", dim=dim), tensor)


def test_scatter_with_explicit_chunk_sizes_and_its_errors():
    tensor = torch.arange(10.0).view(5, 2)
    chunks = local_comm.scatter(tensor, CPU3, chunk_sizes=[1, 3, 1])
    assert [c.shape[0] for c in chunks] == [1, 3, 1]
    assert torch.equal(chunks[1], tensor[1:4])
    with pytest.raises(ValueError, match="sum to"):
        local_comm.scatter(tensor, CPU3, chunk_sizes=[1, 1, 1])
    with pytest.raises(ValueError, match="positive"):
        local_comm.scatter(tensor, CPU3, chunk_sizes=[5, 0, 0])


def test_mixed_devices_and_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="all CUDA or all CPU"):
        local_comm.broadcast_coalesced([torch.ones(2)], ["cpu", 0])
    with pytest.raises(ValueError, match="different numbers"):
        local_comm.reduce_add_coalesced([[torch.ones(2)], []], "cpu")
    with pytest.raises(ValueError, match="CPU tensors gather onto the CPU"):
        local_comm.gather([torch.ones(2)], "cuda:0")
    with pytest.raises(NotImplementedError, match="sparse"):
        local_comm.broadcast_coalesced([torch.eye(2).to_sparse()], CPU3)


class _Recorder:
    """Stands in for torch.cuda.comm and remembers how it was called."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args):
            self.calls.append((name, args))
            return []
        return record


def test_all_cuda_device_lists_go_to_torch_cuda_comm(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(local_comm, "cuda_comm", recorder)
    t = torch.ones(4)
    local_comm.broadcast_coalesced([t], [0, "cuda:1"], buffer_size=123)
    local_comm.reduce_add_coalesced([[t], [t]], "cuda:1", buffer_size=7)
    local_comm.scatter(t, [0, 1], chunk_sizes=[3, 1])
    # (gather dispatches on its inputs' devices: CUDA tensors cannot be made here.)
    names = [name for name, _ in recorder.calls]
    assert names == ["broadcast_coalesced", "reduce_add_coalesced", "scatter"]
    bcast, reduce, scatter = (args for _, args in recorder.calls)
    assert bcast[1] == [torch.device("cuda", 0), torch.device("cuda", 1)] and bcast[2] == 123
    assert reduce[1:] == (1, 7)  # destination as a CUDA index, like torch.cuda.comm wants
    assert scatter[1:] == ([torch.device("cuda", 0), torch.device("cuda", 1)], [3, 1], 0)
