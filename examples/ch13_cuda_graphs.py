"""Chapter 13: the decode step as one CUDA graph replay: the sizes captured, and a batch of 5 padded to 8.

Run from the repository root:  python examples/ch13_cuda_graphs.py

On a CPU it lays a real batch of 5 into the graphs' static buffers (the part a replay reads); on a GPU
it also captures the graphs, replays them, and checks the tokens against the eager step.
"""

import torch
from rich.console import Console
from rich.table import Table

from minioverlap import LLM, SamplingParams
from minioverlap.engine.cuda_graph import StaticInputs, bucket_for, graph_buckets
from minioverlap.engine.forward_batch import ForwardMode

console = Console()
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):", "def is_prime(n):"]

console.rule("the sizes captured")
for max_running in (8, 16, 64):
    console.print(f"max_running={max_running:<3} captured sizes {graph_buckets(max_running)}", highlight=False)
console.print("a batch runs in the smallest that holds it: "
              + ", ".join(f"{n} -> {bucket_for(n, graph_buckets(64))}" for n in (1, 3, 5, 9, 17, 50)), highlight=False)

console.rule("a batch of 5 in the bucket of 8")
llm = LLM(overlap=False, max_running=8)
reqs = llm.make_requests(PROMPTS, SamplingParams(max_tokens=8))
for req in reqs:
    llm.scheduler.add_request(req)
llm.scheduler.normal_loop()                                  # the prefill; the next step decodes all five
batch = llm.runner.batch(ForwardMode.DECODE, reqs)
ctx = llm.runner.attention(batch)                            # the step's page table, read before any replay
input_ids = llm.runner.read_inputs(batch)                    # and its input tokens
buckets = graph_buckets(8)
b = bucket_for(len(reqs), buckets)
inputs = StaticInputs(buckets[-1], ctx.page_table.shape[1] + 4, llm.config.vocab_size, torch.int32, llm.device)
inputs.load(batch, input_ids, ctx.page_table, b)
table = Table("row", "token", "position", "KV slot", "keys", "page table[:4]", "")
for i in range(b):
    table.add_row(str(i), str(inputs.input_ids[i].item()), str(inputs.positions[i].item()),
                  str(inputs.out_cache_loc[i].item()), str(inputs.seq_lens[i].item()),
                  str(inputs.page_table[i, :4].tolist()), "padding" if i >= len(reqs) else f"request {reqs[i].uid}")
console.print(table)
console.print(f"a batch of {len(reqs)} runs in the bucket of {b}: rows {len(reqs)}-{b - 1} are padding "
              "(token 0, position 0, KV slot 0, one key)", highlight=False)
for req in reqs:
    llm.abort(req.uid)

console.rule("on a GPU")
if not torch.cuda.is_available():
    console.print("no CUDA device here: cuda_graphs=None leaves graphs off on a CPU, and cuda_graphs=True is refused")
else:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    graphed = LLM(device="cuda", dtype="float32", max_running=8)
    replayed = []
    for size, graph in graphed.runner.graphs.graphs.items():
        graph.replay = (lambda replay, size: lambda: replayed.append(size) or replay())(graph.replay, size)
    got = [o.token_ids for o in graphed.generate(PROMPTS, params)]
    eager = [o.token_ids for o in LLM(device="cuda", dtype="float32", max_running=8, cuda_graphs=False)
             .generate(PROMPTS, params)]
    console.print(f"captured {sorted(graphed.runner.graphs.graphs)}; {len(replayed)} decode steps replayed the bucket "
                  f"of {sorted(set(replayed))}; tokens {'equal to' if got == eager else 'DIFFERENT from'} the eager step's",
                  highlight=False)
