"""The batch loader: ranks split each global batch, and the stream is independent of world size."""
import numpy as np
import torch

from pretrain.loader import BatchLoader


class CountingSource:
    """Sample g is [g, g+1, ..., g+seq]: easy to tell which global sample a rank received."""

    domain_names = ["a", "b"]

    def __init__(self, seq_len=4):
        self.seq_len = seq_len

    def get(self, g):
        return np.arange(g, g + self.seq_len + 1), g % 2

    def sample_slots(self, g):
        return 1


def first_ids(batches):
    return [int(x) for b in batches for x in b.input_ids[:, 0]]


def test_ranks_partition_each_global_batch():
    world, micro, accum = 2, 2, 3
    loaders = [BatchLoader(CountingSource(), micro, accum, rank, world, torch.device("cpu"), prefetch=2)
               for rank in range(world)]
    for step in range(3):
        seen = sorted(x for loader in loaders for x in first_ids(loader.next_step()))
        assert seen == list(range(step * 12, (step + 1) * 12))
    for loader in loaders:
        loader.close()


def test_same_global_batches_at_any_world_size():
    one = BatchLoader(CountingSource(), 4, 2, 0, 1, torch.device("cpu"))
    two = [BatchLoader(CountingSource(), 4, 1, r, 2, torch.device("cpu")) for r in range(2)]
    for _ in range(3):
        assert sorted(first_ids(one.next_step())) == sorted(x for l in two for x in first_ids(l.next_step()))


def test_labels_are_inputs_shifted_and_domains_reported():
    loader = BatchLoader(CountingSource(), 2, 1, 0, 1, torch.device("cpu"), prefetch=0)
    batch = loader.next_step()[0]
    assert torch.equal(batch.labels[:, :-1], batch.input_ids[:, 1:])
    assert batch.input_ids.dtype == torch.int64 and batch.domains.tolist() == [0, 1]


def test_state_round_trip_and_skip():
    a = BatchLoader(CountingSource(), 2, 2, 0, 1, torch.device("cpu"))
    a.next_step()
    state = a.state_dict()
    expected = first_ids(a.next_step())
    b = BatchLoader(CountingSource(), 2, 2, 0, 1, torch.device("cpu"))
    b.next_step(); b.next_step(); b.next_step()  # prefetched far ahead
    b.load_state_dict(state)
    assert first_ids(b.next_step()) == expected
    b.skip(2)
    assert first_ids(b.next_step()) == list(range(16, 20))
