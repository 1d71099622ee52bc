"""The face of the engine: `LLM(...)`, `llm.generate(prompts, params)` and, from chapter 04,
`llm.stream`, `llm.abort` and `llm.check_integrity`.

The names stay the same from chapter 01 on; what serves them changes: one prompt at a time with a
contiguous cache (01), on the paged cache (02), one batch for all prompts (03), the scheduler's loop (04).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

# >>> ch02 replaces ch01: the paged cache
#| from minioverlap.engine.contiguous import greedy_generate
# >>> ch03 replaces ch02: one batch for many requests
#| from minioverlap.engine.model_runner import ModelRunner, paged_greedy_generate
# >>> ch04 replaces ch03: the scheduler
#| from minioverlap.engine.batch_generate import generate_batch
#| from minioverlap.engine.model_runner import ModelRunner
from minioverlap.engine.model_runner import ModelRunner
# <<< ch04
# <<< ch03
# <<< ch02
from minioverlap.engine.request import Req
from minioverlap.model.loader import DTYPES, checkpoint_dtype, load_model, load_tokenizer, resolve_model_dir
from minioverlap.sampling_params import SamplingParams
# >>> ch04: the scheduler
from minioverlap.device.trace import Trace
from minioverlap.scheduler.scheduler import Reply, Scheduler
# <<< ch04
# >>> ch08: the hazard checker
from minioverlap.device.hazard import HazardChecker
# <<< ch08

Prompt = str | list[int]
Params = SamplingParams | list[SamplingParams] | None


@dataclass
class RequestOutput:
    uid: int                           # the request's id, in the order the prompts were given
    prompt_token_ids: list[int]
    token_ids: list[int]               # the generated tokens (EOS included if hit)
    text: str                          # the generated tokens decoded (special tokens skipped)
    finish_reason: str | None          # "stop" (EOS or a stop token), "length" (max_tokens or the context), "abort"


class LLM:
    """Load a checkpoint and generate from prompts (text or token ids)."""

    def __init__(self, model: str = "tiny", device: str = "cpu", dtype: str | torch.dtype | None = None,
                 max_seq_len: int | None = None,
                 # >>> ch02: the paged cache
                 page_size: int = 16, num_pages: int | None = None,
                 # <<< ch02
                 # >>> ch03: batching
                 max_running: int = 16,
                 # <<< ch03
                 # >>> ch06: the overlap loop
                 # >>> ch07 replaces ch06: its bugs fixed, the overlap loop is the default
                 #| overlap: bool = False,
                 overlap: bool = True,
                 # <<< ch07
                 # <<< ch06
                 # >>> ch08: the fence and the hazard checker
                 fence: bool = True, hazard_check: bool = False,
                 # <<< ch08
                 ) -> None:
        self.model_dir = resolve_model_dir(model)
        self.device = _check_device(device)
        self.dtype = _resolve_dtype(dtype, self.device, self.model_dir)
        self.model = load_model(self.model_dir, self.dtype, self.device)
        self.config = self.model.config
        self.tokenizer = load_tokenizer(self.model_dir)
        limit = self.config.max_position_embeddings
        if max_seq_len is not None and not (isinstance(max_seq_len, int) and 2 <= max_seq_len <= limit):
            raise ValueError(f"max_seq_len must be an integer in [2, {limit}] (the model's context), got {max_seq_len!r}")
        self.max_seq_len = max_seq_len or limit
        self.next_uid = 0
        # >>> ch02: the paged cache
        # >>> ch03 replaces ch02: many request slots
        #| self.max_running = 1
        self.max_running = _check_int("max_running", max_running, 1)
        # <<< ch03
        page_size = _check_int("page_size", page_size, 1)
        pages_per_seq = -(-self.max_seq_len // page_size)
        num_pages = self.max_running * pages_per_seq + 1 if num_pages is None else num_pages
        _check_int("num_pages", num_pages, 2)
        # >>> ch08 replaces ch02: the hazard checker
        #| self.runner = ModelRunner(self.model, num_pages=num_pages, page_size=page_size,
        #|                           max_running=self.max_running, max_seq_len=self.max_seq_len)
        for name, value in (("fence", fence), ("hazard_check", hazard_check)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        self.runner = ModelRunner(self.model, num_pages=num_pages, page_size=page_size, max_running=self.max_running,
                                  max_seq_len=self.max_seq_len, hazards=HazardChecker() if hazard_check else None)
        # <<< ch08
        # <<< ch02
        # >>> ch04: the scheduler
        self.scheduler = Scheduler(self.runner)
        # <<< ch04
        # >>> ch08: fence=False only to show the race it prevents
        self.scheduler.fence = fence
        # <<< ch08
        # >>> ch06: the overlap loop
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        self.overlap = overlap
        # <<< ch06

    def encode(self, prompt: Prompt) -> list[int]:
        """Text or token ids -> token ids, checked against the vocabulary and the context."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt is text but {self.model_dir} has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt).ids
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty: it must hold at least 1 token")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.config.vocab_size)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.max_seq_len}, "
                             f"so a prompt may have at most {self.max_seq_len - 1}")
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""

    def make_request(self, prompt: Prompt, params: SamplingParams) -> Req:
        """A checked request with its stop rules: EOS unless ignore_eos, max_tokens, the context limit."""
        ids = self.encode(prompt)
        stop = set() if params.ignore_eos else set(self.config.eos_token_ids)
        # >>> ch04: stop tokens
        bad = [t for t in params.stop_token_ids if not (isinstance(t, int) and 0 <= t < self.config.vocab_size)]
        if bad:
            raise ValueError(f"stop_token_ids holds {bad[0]!r}, outside the vocabulary [0, {self.config.vocab_size})")
        stop |= set(params.stop_token_ids)
        # <<< ch04
        return Req(-1, ids, params, min(params.max_tokens, self.max_seq_len - len(ids)), frozenset(stop))

    def make_requests(self, prompts: Prompt | list[Prompt], params: Params) -> list[Req]:
        """Check every prompt first; only if all pass do they get their uids. `params` is one
        SamplingParams for all prompts or a list of one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError(f"prompts must be a prompt or a non-empty list of prompts, got {prompts!r}")
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params is a list of {len(params)} SamplingParams for {len(prompts)} prompts")
        reqs = [self.make_request(p, s) for p, s in zip(prompts, params)]
        for req in reqs:
            req.uid, self.next_uid = self.next_uid, self.next_uid + 1
        return reqs

    def generate(self, prompts: Prompt | list[Prompt], params: Params = None) -> list[RequestOutput]:
        """Complete every prompt. Every prompt is checked before any runs."""
        reqs = self.make_requests(prompts, params)
        # >>> ch02 replaces ch01: the paged cache
        #| for req in reqs:
        #|     req.output_ids = greedy_generate(self.model, req.prompt_ids, req.max_new_tokens, tuple(req.stop_ids))
        #|     req.finish_reason = req.check_stop()
        # >>> ch03 replaces ch02: one batch for many requests
        #| for req in reqs:
        #|     req.output_ids = paged_greedy_generate(self.runner, req.prompt_ids, req.max_new_tokens, tuple(req.stop_ids))
        #|     req.finish_reason = req.check_stop()
        # >>> ch04 replaces ch03: the scheduler's loop, which admits requests as room frees up
        #| for start in range(0, len(reqs), self.max_running):
        #|     generate_batch(self.runner, reqs[start:start + self.max_running])
        for _ in self._serve(reqs):
            pass
        # <<< ch04
        # <<< ch03
        # <<< ch02
        return [RequestOutput(r.uid, r.prompt_ids, r.output_ids, self.decode(r.output_ids), r.finish_reason)
                for r in reqs]
    # >>> ch04: the scheduler

    def stream(self, prompts: Prompt | list[Prompt], params: Params = None) -> Iterator[Reply]:
        """Yield replies as the scheduler handles them: r.uid, r.token_ids (the new ones), r.finished.
        The prompts are checked before the first reply (ValueError on a bad one)."""
        return self._serve(self.make_requests(prompts, params))

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Add one request to a run in progress (a `stream` being consumed); returns its uid.
        A bad request raises ValueError here and changes nothing."""
        [req] = self.make_requests([prompt], params)
        self.scheduler.add_request(req)
        return req.uid

    def abort(self, uid: int) -> None:
        """Stop a request: it frees its pages and slot, and its last reply has finish_reason 'abort'."""
        self.scheduler.abort(uid)

    def _serve(self, reqs: list[Req]) -> Iterator[Reply]:
        for req in reqs:
            self.scheduler.add_request(req)
        self.scheduler.start_run()
        # >>> ch06 replaces ch04: both loops, side by side
        #| while self.scheduler.busy:
        #|     yield from self.scheduler.normal_loop()
        with self.scheduler.streams.schedule():
            while not self.overlap and self.scheduler.busy:
                yield from self.scheduler.normal_loop()
            last = None                          # the overlap loop's step in flight
            while self.overlap and (self.scheduler.busy or last is not None):
                last, replies = self.scheduler.overlap_loop(last)
                yield from replies
        # <<< ch06

    @property
    def trace(self) -> Trace:
        """The event list of the last run."""
        return self.scheduler.trace

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every page and request slot is free or owned exactly once."""
        self.scheduler.check_integrity()
    # <<< ch04

    def shutdown(self) -> None:
        """Nothing to stop: the engine runs in the caller's thread, step by step."""


def _check_int(name: str, value: int, minimum: int) -> int:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_device(device: str) -> str:
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (optionally 'cuda:N'), got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA GPU")
    return str(device)


def _resolve_dtype(dtype: str | torch.dtype | None, device: str, model_dir) -> torch.dtype:
    """None: fp32 on CPU (fast and exact there), the checkpoint's own dtype on a GPU."""
    if dtype is None:
        return torch.float32 if device == "cpu" else checkpoint_dtype(model_dir)
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
