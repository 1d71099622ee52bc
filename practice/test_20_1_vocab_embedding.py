# >>> ch20 file: the judge's own test of exercise 20.1
"""Exercise 20.1, judged in one process: the vocabulary-parallel embedding, one layer per rank.

Rank r of N holds rows [r*V/N, (r+1)*V/N) of the embedding table (its `rows`; the loader gives it
`full[layer.weight_slice]`). For each token it must give that token's row if it holds it and zeros if not,
so that the all-reduce, a sum over the ranks, is the full lookup on every rank. Here the group is a fake
whose all_reduce hands its input back as it is: each rank's output is its own part, and the test sums the
parts itself. The sum must equal F.embedding over the full table exactly (one rank adds its row, the others
add zeros), for any shape of token ids.

    python practice/judge.py test 20.1
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minioverlap.parallel.layers import VocabParallelEmbedding

VOCAB, HIDDEN = 64, 8


class FakeGroup:
    """One rank of a group, without processes: all_reduce returns its input (this rank's part) unchanged,
    and counts its calls."""

    def __init__(self, tp_rank: int, tp_size: int) -> None:
        self.tp_rank, self.tp_size, self.reduced = tp_rank, tp_size, 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced += 1
        return x


def full_table(seed: int = 20) -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))


def ranks(tp_size: int, full: torch.Tensor) -> list[VocabParallelEmbedding]:
    """One layer per rank, each loaded with its shard of `full`, as the shard loader does."""
    layers = []
    for rank in range(tp_size):
        layer = VocabParallelEmbedding(VOCAB, HIDDEN, FakeGroup(rank, tp_size))
        with torch.no_grad():
            layer.weight.copy_(full[layer.weight_slice])
        layers.append(layer)
    return layers


def edge_ids(tp_size: int) -> torch.Tensor:
    """The first and last ids, the ids on each side of every shard boundary, and repeats."""
    part = VOCAB // tp_size
    edges = [i for r in range(1, tp_size) for i in (r * part - 1, r * part)]
    return torch.tensor([0, VOCAB - 1, *edges, 5, 5, VOCAB - 1, 0, part, part - 1, part])


def lookup(layer: VocabParallelEmbedding, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return layer(ids)


def each_rank_s_lookup(tp_size: int):
    """(rank, its rows, position, token, the token's output row, its full-table row) for each edge id on each rank."""
    full = full_table()
    ids = edge_ids(tp_size)
    for rank, layer in enumerate(ranks(tp_size, full)):
        out = lookup(layer, ids)
        assert out.shape == (len(ids), HIDDEN), f"rank {rank} of {tp_size}: shape {tuple(out.shape)}"
        for i, token in enumerate(ids.tolist()):
            yield rank, layer.rows, i, token, out[i], full[token]


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_gives_its_own_rows(tp_size):
    for rank, rows, i, token, got, want in each_rank_s_lookup(tp_size):
        if rows.start <= token < rows.stop:
            assert torch.equal(got, want), f"rank {rank} of {tp_size} (rows {rows.start}..{rows.stop - 1}): " \
                                           f"token {token} (position {i}) is not its row of the full table"


@pytest.mark.parametrize("tp_size", [2, 4])
def test_the_other_ranks_tokens_give_zeros(tp_size):
    for rank, rows, i, token, got, want in each_rank_s_lookup(tp_size):
        if not rows.start <= token < rows.stop:
            assert torch.count_nonzero(got) == 0, \
                f"rank {rank} of {tp_size} (rows {rows.start}..{rows.stop - 1}): token {token} (position {i}) is " \
                f"another rank's, yet its output is not zeros: {got.tolist()}"


@pytest.mark.parametrize("tp_size", [2, 4])
def test_the_sum_over_the_ranks_is_the_full_lookup(tp_size):
    full = full_table()
    layers = ranks(tp_size, full)
    generator = torch.Generator().manual_seed(tp_size)
    for ids in [edge_ids(tp_size), torch.arange(VOCAB), torch.randint(0, VOCAB, (50,), generator=generator)]:
        total = sum(lookup(layer, ids) for layer in layers)
        want = F.embedding(ids, full)
        wrong = (total != want).any(-1).nonzero().flatten().tolist()
        assert not wrong, f"{tp_size} ranks: the sum over the ranks is not the full table's row for tokens " \
                          f"{ids[wrong].tolist()} (positions {wrong})"


def test_a_batch_of_prompts_keeps_its_shape():
    """input_ids [T] -> [T, hidden]; [B, T] -> [B, T, hidden], each row as the flat lookup gives it."""
    full = full_table()
    layers = ranks(2, full)
    ids = torch.tensor([[0, 31, 32, 63], [7, 7, 40, 1], [63, 62, 33, 30]])
    for rank, layer in enumerate(layers):
        flat = lookup(layer, ids[0])
        assert flat.shape == (4, HIDDEN), f"rank {rank}: input [4] gives {tuple(flat.shape)}, not [4, {HIDDEN}]"
        batch = lookup(layer, ids)
        assert batch.shape == (3, 4, HIDDEN), \
            f"rank {rank}: input [3, 4] gives {tuple(batch.shape)}, not [3, 4, {HIDDEN}]"
        assert torch.equal(batch.reshape(-1, HIDDEN), lookup(layer, ids.flatten())), \
            f"rank {rank}: a batch's rows differ from the same ids looked up flat"
    assert torch.equal(sum(lookup(layer, ids) for layer in layers), F.embedding(ids, full))


def test_the_rank_s_part_goes_through_the_all_reduce():
    """Every rank needs the full embedding: what forward returns is the group's all_reduce of its part, once
    per call (the real group sums the ranks' parts; this fake returns the part)."""
    full = full_table()
    for layer in ranks(4, full):
        out = lookup(layer, edge_ids(4))
        assert layer.group.reduced == 1, \
            f"rank {layer.group.tp_rank}: all_reduce called {layer.group.reduced} times in one forward, not once"
        assert out.shape == (len(edge_ids(4)), HIDDEN)
