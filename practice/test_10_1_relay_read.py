# >>> ch10 file: the judge's own test of exercise 10.1
"""Exercise 10.1, judged on a relay alone: Relay.read gives a step's rows of the three buffers.

The relay keeps one row per request slot in new_seq_lens [slots], draft_token [slots] and hidden
[slots, hidden]; a step hands read its request slots, a device tensor [B] (and the same numbers on the
host, for the checker), and gets the rows of those slots, in that order, on the device. Here the
buffers are filled by hand, each row telling its slot, and a relay on the meta device (tensors with a
shape and no values) proves that read asks the host for nothing.

    python practice/judge.py test 10.1
"""

from __future__ import annotations

import torch

from minioverlap.speculative.relay import Relay

SLOTS, HIDDEN = 6, 4


def filled() -> Relay:
    """A relay whose row s holds new_seq_lens 10 s + 3, draft_token 100 + s and hidden 4 s .. 4 s + 3."""
    relay = Relay(SLOTS, HIDDEN, torch.float32, "cpu")
    relay.new_seq_lens.copy_(torch.arange(SLOTS) * 10 + 3)
    relay.draft_token.copy_(torch.arange(SLOTS) + 100)
    relay.hidden.copy_(torch.arange(SLOTS * HIDDEN, dtype=torch.float32).view(SLOTS, HIDDEN))
    return relay


def test_read_gives_each_slot_s_rows_in_the_order_of_the_batch():
    """Slots 4, 1, 3: the lengths 43, 13, 33, the drafts 104, 101, 103, and the hidden rows of slots 4, 1
    and 3, in that order; the buffers themselves unchanged."""
    relay = filled()
    before = [buffer.clone() for buffer in (relay.new_seq_lens, relay.draft_token, relay.hidden)]
    seq_lens, draft, hidden = relay.read(torch.tensor([4, 1, 3]), [4, 1, 3])
    assert seq_lens.tolist() == [43, 13, 33]
    assert draft.tolist() == [104, 101, 103]
    assert hidden.tolist() == [[16.0, 17.0, 18.0, 19.0], [4.0, 5.0, 6.0, 7.0], [12.0, 13.0, 14.0, 15.0]]
    after = (relay.new_seq_lens, relay.draft_token, relay.hidden)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "read changes no buffer"


def test_a_batch_of_one_gets_tensors_of_one_row():
    """One slot, 5: [1] lengths and drafts, a [1, hidden] hidden state; the dtypes the buffers have."""
    relay = filled()
    seq_lens, draft, hidden = relay.read(torch.tensor([5]), [5])
    assert (seq_lens.shape, draft.shape, hidden.shape) == ((1,), (1,), (1, HIDDEN))
    assert (seq_lens.dtype, draft.dtype, hidden.dtype) == (torch.int64, torch.int64, torch.float32)
    assert (seq_lens.item(), draft.item(), hidden[0, 0].item()) == (53, 105, 20.0)


def test_read_stays_on_the_device():
    """A relay on the meta device, whose tensors have shapes and no values: reading slots of it gives
    meta tensors of [B], [B] and [B, hidden]. A .tolist(), .item() or int() of the slots or of a buffer
    would fail here: on a GPU, each would stall the host until the device got there."""
    relay = Relay(SLOTS, HIDDEN, torch.float32, "meta")
    seq_lens, draft, hidden = relay.read(torch.empty(3, dtype=torch.int64, device="meta"), [4, 1, 3])
    assert all(t.device.type == "meta" for t in (seq_lens, draft, hidden))
    assert (seq_lens.shape, draft.shape, hidden.shape) == ((3,), (3,), (3, HIDDEN))
