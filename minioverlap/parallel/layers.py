# >>> ch20 file: the tensor-parallel layers
"""The tensor-parallel layers: each holds one rank's shard of a weight and knows where that shard sits.

A linear layer y = x W^T (W is [out, in]) splits two ways, and a Qwen3 block uses both, in pairs:

    ColumnParallelLinear   W's rows (output features) cut by rank: rank r computes its slice of y.
                           q/k/v by heads, gate/up by columns. No communication.
    RowParallelLinear      W's columns (input features) cut by rank: rank r multiplies its slice of x
                           (exactly what a column-parallel layer before it produced) and the ranks'
                           partial products are summed by an all-reduce. o_proj, down_proj.

So attention and the MLP each cost one all-reduce per layer: column-parallel in, row-parallel out, and
everything between (QK-norm, RoPE, attention per head, SiLU times up) is per head or per feature, so
it runs on the slice unchanged. The vocabulary splits by rows too:

    VocabParallelEmbedding rank r holds rows [r*P, (r+1)*P) of the V, P = ceil(V/N) (the last rank
                           fewer when N does not divide V); a token outside them reads zeros; the
                           all-reduce gives every rank the full embedding.
    ParallelLMHead         the same rows as logits: each rank scores its slice of the vocabulary, padded
                           to P columns, and an all-gather puts the slices side by side, cut to V: every
                           rank holds all logits.

A vocabulary that tp_size does not divide is padded, as SGLang's and vLLM's vocab-parallel embeddings
pad theirs: a checkpoint of 151,936 tokens splits over any N, and the tiny tests' 517 over 2 or 4.
vLLM rounds the vocabulary up to a multiple of 64 (`pad_vocab_size`), splits that, and pads the weight
with rows of zeros; here the weight holds only its real rows, and the head pads its logits, the one
place where the ranks' sizes must match.

Each layer's `weight_slice` is the index of its shard in the full checkpoint tensor: the loader reads
exactly that part from the file (`full[layer.weight_slice]` is the shard), never the whole tensor.

References: Megatron-LM (Shoeybi et al., 2019), section 3; SGLang's layers/linear.py and
layers/vocab_parallel_embedding.py, whose class names this file keeps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minioverlap.parallel.group import TPGroup

ALL = slice(None)


def shard_range(size: int, tp_rank: int, tp_size: int, what: str = "size") -> slice:
    """Rank tp_rank's equal part of `size` things: [r*size/N, (r+1)*size/N). `what` names them in the
    error when they do not divide."""
    if size % tp_size:
        raise ValueError(f"{what} ({size}) must be divisible by tp_size ({tp_size})")
    part = size // tp_size
    return slice(tp_rank * part, (tp_rank + 1) * part)


def kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> slice:
    """The KV heads rank tp_rank holds. With at least tp_size of them, an equal part; with fewer, the one
    head its query heads read, r * num_kv_heads // tp_size: each KV head is then stored on
    tp_size // num_kv_heads ranks (GQA's sharing, spread across devices, as SGLang does)."""
    if num_kv_heads >= tp_size:
        return shard_range(num_kv_heads, tp_rank, tp_size, "num_key_value_heads")
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size ({tp_size}) must be a multiple of num_key_value_heads ({num_kv_heads}) "
                         "when it exceeds them, so that each rank's query heads read one KV head")
    head = tp_rank * num_kv_heads // tp_size
    return slice(head, head + 1)


def features(heads: slice, head_dim: int) -> slice:
    """Heads [a, b) -> their features [a*head_dim, b*head_dim) in a projection's rows or columns."""
    return slice(heads.start * head_dim, heads.stop * head_dim)


def width(s: slice) -> int:
    return s.stop - s.start


class ColumnParallelLinear(nn.Module):
    """x [T, in] -> this rank's output features [T, width(rows)]: rows `rows` of the full W [out, in]."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup, rows: slice | None = None) -> None:
        super().__init__()
        self.rows = rows if rows is not None else shard_range(out_features, group.tp_rank, group.tp_size, "out_features")
        self.weight_slice = (self.rows, ALL)
        self.weight = nn.Parameter(torch.empty(width(self.rows), in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """This rank's input features [T, width(cols)] -> the full output [T, out], summed over the ranks:
    columns `cols` of the full W [out, in] give a partial product, and the all-reduce adds the rest."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup, cols: slice | None = None) -> None:
        super().__init__()
        self.group = group
        self.cols = cols if cols is not None else shard_range(in_features, group.tp_rank, group.tp_size, "in_features")
        self.weight_slice = (ALL, self.cols)
        self.weight = nn.Parameter(torch.empty(out_features, width(self.cols)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> slice:
    """Rank tp_rank's rows of a vocabulary padded to tp_size equal parts of P = ceil(vocab_size / tp_size):
    [r*P, (r+1)*P), cut at vocab_size (the padding's rows exist nowhere)."""
    part = -(-vocab_size // tp_size)
    return slice(min(tp_rank * part, vocab_size), min((tp_rank + 1) * part, vocab_size))


class VocabParallelEmbedding(nn.Module):
    """input_ids [T] -> embeddings [T, hidden]; this rank holds vocabulary rows `rows`."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.vocab_size, self.part = vocab_size, -(-vocab_size // group.tp_size)      # P: each rank's padded part
        self.rows = vocab_range(vocab_size, group.tp_rank, group.tp_size)
        self.weight_slice = (self.rows, ALL)
        self.weight = nn.Parameter(torch.empty(width(self.rows), hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each token's row if this rank holds it, zeros if not; the sum over the ranks is the full lookup."""
        # >>> exercise 20.1: the vocabulary-parallel embedding
        mine = (input_ids >= self.rows.start) & (input_ids < self.rows.stop)
        local = torch.where(mine, input_ids - self.rows.start, 0)          # row 0 stands in, then is zeroed
        out = F.embedding(local, self.weight).masked_fill(~mine.unsqueeze(-1), 0)
        return self.group.all_reduce(out)
        # <<< exercise 20.1


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [N, hidden] -> logits [N, vocab] over the full vocabulary, on every rank. It holds the same
    rows as the embedding (and, tied, the same tensor): rank r scores tokens in `rows`, and the
    all-gather puts the ranks' slices in vocabulary order, so every rank samples from the same scores. A
    slice shorter than P (the last rank's, in a padded vocabulary) is padded to P first: the all-gather
    takes equal pieces; the padding's columns are cut off after it."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.pad(F.linear(hidden, self.weight), (0, self.part - width(self.rows)))
        return self.group.all_gather(logits, dim=-1)[..., :self.vocab_size]
