# >>> ch16 file: the messages between the two processes
"""The messages between the HTTP side and the scheduler process, in a module both import: the HTTP side
(api.py, client.py) never imports the engine (engine.py, and through it llm.py and the model).

Each is a small dataclass pickled through a multiprocessing pipe, so its fields are plain Python values.
"""

from __future__ import annotations

from dataclasses import dataclass

from minioverlap.sampling_params import SamplingParams


# ---- the HTTP side to the scheduler
@dataclass
class Add:
    """A request the HTTP side has checked (Processor.make_request): the scheduler only adds it."""
    rid: int                          # the request's id, given by the HTTP side (the engine's uid)
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int               # max_tokens, or fewer where the context ends first
    stop_ids: tuple[int, ...]         # the tokens that end it (EOS unless ignore_eos, and stop_token_ids)


@dataclass
class Abort:
    rid: int                          # a request that finished already is left as it is


@dataclass
class Integrity:
    """Ask for the integrity report (tests, and a curious operator)."""


@dataclass
class Stop:
    """Abort what is left and exit."""


# ---- the scheduler to the HTTP side
@dataclass
class Ready:
    max_seq_len: int                  # the context the engine serves: the HTTP side checks prompts against it


@dataclass
class Failed:
    error: str                        # the engine could not be built (a bad option, a checkpoint it refuses)


@dataclass
class Accepted:
    rid: int


@dataclass
class Rejected:
    rid: int
    error: str                        # why the engine refused it (a request too large for the page pool)
    # >>> ch19: a grammar the engine could not compile: SamplingParams' field that asked for it
    field: str | None = None          # None: the page pool
    # <<< ch19


@dataclass
class Tokens:
    rid: int
    token_ids: list[int]              # the new tokens of one step
    finished: bool
    finish_reason: str | None
    error: str | None                 # why it failed alone (finish_reason "error")
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None   # per token: its logprob, the top (id, logprob)
    # >>> ch17: the prefix cache
    cached_tokens: int = 0            # prompt tokens served from the prefix cache
    # <<< ch17


@dataclass
class Report:
    idle: bool                        # nothing queued, running or in flight: only then must everything be free
    problems: str | None              # IntegrityError's message, or None
    free_pages: int
    usable_pages: int
    free_rows: int
    max_running: int
    finishes: dict[str, int]          # requests ended since the start, by finish_reason ("stop", "abort", ...)
    kernels: bool                     # the engine's step takes chapter 15's fast path
    running: int = 0                  # requests running (/metrics' gauges)
    queued: int = 0                   # requests waiting for a slot, or in the inbox
    # >>> ch21: retraction
    retractions: int = 0              # requests taken back since the start (admission by need)
    # <<< ch21
