"""Chapter 10: a speculative step whose inputs from the host are slot numbers only.

Run from the repository root:  python examples/ch10_relay.py
"""

from rich.console import Console
from rich.table import Table

from minioverlap import LLM, SamplingParams
from minioverlap.engine.forward_batch import ForwardMode

console = Console()
llm = LLM(overlap=False, mtp_steps=3, max_running=2)
runner, relay = llm.runner, llm.runner.relay
prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
reqs = llm.make_requests(prompts, SamplingParams(max_tokens=24))
for req in reqs:
    llm.scheduler.add_request(req)
llm.scheduler.normal_loop()                        # the prefill: each request's row of the relay is written
llm.scheduler.normal_loop()                        # one verify step: the rows move on

console.rule("what the host hands the next step")
batch = runner.batch(ForwardMode.DECODE, reqs)
fields = ("req_pool_indices", "positions", "out_cache_loc", "seq_lens")
for name in fields:
    value = getattr(batch, name)
    console.print(f"{name:17} {value.tolist() if value is not None else None}")
console.print(f"{'drafter inputs':17} none: the relay holds them")

console.rule("the relay's rows of those slots (on the device)")
table = Table("slot", "request", "new_seq_lens", "draft_token", "hidden[:4]", "host's seq_len")
for req in reqs:
    hidden = ", ".join(f"{x:+.2f}" for x in relay.hidden[req.row, :4].tolist())
    table.add_row(str(req.row), str(req.uid), str(relay.new_seq_lens[req.row].item()),
                  f"{relay.draft_token[req.row].item()} {llm.decode([relay.draft_token[req.row].item()])!r}",
                  hidden, str(req.seq_len))
console.print(table)

console.rule("the step lays its window out from them, on the device")
batch, (first, hidden) = runner.resolve(batch)      # a new batch: the one the host built stays as it was
W = batch.extend_lens[0]
for name in ("positions", "out_cache_loc"):
    rows = getattr(batch, name).view(len(reqs), W).tolist()
    console.print(f"{name:17} " + "   ".join(f"slot {r.row}: {row}" for r, row in zip(reqs, rows)))
console.print(f"{'seq_lens':17} {batch.seq_lens.tolist()}")
console.print(f"{'drafter inputs':17} first drafts {first.tolist()}, hidden states {list(hidden.shape)}")
console.print("positions start at each slot's new_seq_lens; the KV slots are req_to_token's at those positions")

llm.abort(reqs[0].uid)
llm.abort(reqs[1].uid)
llm.scheduler.receive()
llm.check_integrity()
