"""Chapter 02: the paged KV cache gives chapter 01's tokens, and its pages can be drawn.

    python examples/ch02_paged_cache.py
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from minioverlap import LLM, SamplingParams
from minioverlap.reference.contiguous import greedy_generate
from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.engine.model_runner import ModelRunner

PROMPT = "def fibonacci(n):"
console = Console()

for page_size in (1, 4, 16):
    llm = LLM(model="tiny", page_size=page_size)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=32))[0]
    same = out.token_ids == greedy_generate(llm.model, out.prompt_token_ids, 32, llm.config.eos_token_ids)
    print(f"page_size {page_size:2d}: {len(out.token_ids)} tokens, equal to chapter 01's contiguous cache: {same}")

# Draw where one request's tokens live: its pages, and the KV slot of each position.
runner = ModelRunner(llm.model, num_pages=8, page_size=4, max_running=2, max_seq_len=32)
req = llm.make_request(PROMPT, SamplingParams(max_tokens=4))
req.row = runner.tables.alloc()
runner.batch(ForwardMode.EXTEND, [req])
table = Table("position", "token", "page", "KV slot", title=f"request slot {req.row}: pages {req.pages} of 4 slots")
row = runner.tables.req_to_token[req.row]
for pos, token in enumerate(req.prompt_ids):
    table.add_row(str(pos), repr(llm.decode([token])), str(int(row[pos]) // 4), str(int(row[pos])))
console.print(table)
print(f"free pages left: {runner.allocator.num_free} of {runner.allocator.num_pages - 1} (page 0 is never handed out)")
