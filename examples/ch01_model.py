"""Chapter 01: the tiny model completes a prompt, and its tokens equal transformers'.

    python examples/ch01_model.py
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging

from minioverlap import LLM, SamplingParams

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 48

llm = LLM(model="tiny")
out = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS))[0]
print(f"prompt: {PROMPT!r} -> {len(out.prompt_token_ids)} tokens {out.prompt_token_ids}")
print("completion:")
print(PROMPT + out.text)
print(f"finish_reason: {out.finish_reason}")

logging.set_verbosity_error()            # transformers reports the MTP layer's tensors as unused
logging.disable_progress_bar()
hf = AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=torch.float32)
ref = hf.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                  eos_token_id=list(llm.config.eos_token_ids), pad_token_id=0)[0, len(out.prompt_token_ids):].tolist()
same = sum(a == b for a, b in zip(out.token_ids, ref))
print(f"tokens equal transformers' Qwen3ForCausalLM.generate: {out.token_ids == ref} ({same} of {len(ref)})")
