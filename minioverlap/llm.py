"""The face of the engine: `LLM(...)`, `llm.generate(prompts, params)` and, from chapter 04,
`llm.stream`, `llm.abort` and `llm.check_integrity`.

The names stay the same from chapter 01 on; what serves them changes: one prompt at a time with a
contiguous cache (01), on the paged cache (02), one batch for all prompts (03), the scheduler's loop (04).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from minioverlap.config import EngineArgs
# >>> ch13: CUDA graphs
from minioverlap.config import use_cuda_graphs
# <<< ch13
# >>> ch02 removes ch01: chapter 01's path: one prompt at a time, a contiguous cache
#| from minioverlap.reference.contiguous import serve
# <<< ch02
# >>> ch03 removes ch02: chapter 02's path: one prompt at a time, on the paged cache
#| from minioverlap.reference.paged_greedy import serve
# <<< ch03
# >>> ch04 removes ch03: chapter 03's path: one batch of up to max_running prompts at a time
#| from minioverlap.reference.batch_generate import serve
# <<< ch04
# >>> ch02: the paged cache
from minioverlap.engine.model_runner import ModelRunner
# <<< ch02
from minioverlap.engine.request import Req
from minioverlap.model.loader import DTYPES, checkpoint_dtype, load_model, load_tokenizer, resolve_model_dir
from minioverlap.processor import Params, Processor, Prompt, RequestOutput
from minioverlap.sampling_params import SamplingParams, _integer, integral
# >>> ch04: the scheduler
from minioverlap.device.trace import Trace
from minioverlap.scheduler.scheduler import Reply, Scheduler
# <<< ch04
# >>> ch08: the hazard checker
from minioverlap.device.hazard import HazardChecker
# <<< ch08
# >>> ch09: the MTP drafter, and the runner that speculates with it
from minioverlap.speculative.runner import SpecRunner
from minioverlap.model.mtp import MTPLayer, load_mtp
# <<< ch09
# >>> ch15: the fast path
from minioverlap.config import use_kernels
from minioverlap.engine.backend import backend
# <<< ch15
# >>> ch18: chunked prefill
from minioverlap.config import chunk_size
# <<< ch18
# >>> ch19: the n-gram drafter on the host
from minioverlap.speculative.ngram import NgramRunner
# <<< ch19
# >>> ch20: several devices
from minioverlap.model.qwen3 import Qwen3ForCausalLM
from minioverlap.parallel.group import TPGroup
from minioverlap.parallel.dp_scheduler import DPScheduler
from minioverlap.parallel.loader import load_dp_model, load_tp_model
from minioverlap.parallel.mtp import load_tp_mtp
from minioverlap.parallel.ranks import Ranks
# <<< ch20

class LLM:
    """Load a checkpoint and generate from prompts (text or token ids)."""

    def __init__(self, model: str = "tiny",
                 # >>> ch20: a rank's engine is given its group (Ranks starts it, in the rank's process)
                 _group: TPGroup | None = None,
                 # <<< ch20
                 **options) -> None:
        """Load the checkpoint and build the engine: the runner (the model, the page pool, the tables), from
        chapter 13 its graphs, from chapter 17 its prefix cache, and the scheduler (from chapter 18 with the
        step's budget of prompt tokens). `options` are the fields
        of EngineArgs (minioverlap/config.py), each with its default there and the chapter that adds it.

        From chapter 20, with tp_size > 1, this process is rank 0: before it loads anything it starts the
        other ranks (parallel/ranks.py), processes that build this same engine over their own shards, and
        joins their group; then it loads its own shard, and its scheduler shares its inbox with theirs
        before every iteration. Each of those processes makes its LLM with `_group`, the group it has
        joined, and starts nothing. shutdown() stops them. If another rank fails or dies, rank 0's next
        exchange with it raises RankFailed, with its traceback, and every other rank's process is stopped:
        the engine cannot go on without a shard of every layer."""
        self.args = _engine_args(model, options)
        self.model_dir = resolve_model_dir(model)
        self.device = _check_device(self.args.device)
        self.dtype = _resolve_dtype(self.args.dtype, self.device, self.model_dir)
        # >>> ch20: with tp_size > 1, rank 0 (this process) starts the other ranks, each loading its shard
        starts_ranks = self.args.tp_size > 1 and _group is None
        self.ranks = Ranks(model, options, self.args.tp_size, self.device, self.args.dist_timeout) if starts_ranks else None
        self.group = _group or (self.ranks.group if self.ranks else TPGroup.single())
        # <<< ch20
        # >>> ch15 replaces ch01: the fast path or the reference, chosen once (kernels=None: on for CUDA, off for CPU)
        #| self.model = load_model(self.model_dir, self.dtype, self.device)
        self.backend = backend(use_kernels(self.args))
        # >>> ch20 replaces ch15: or this rank's shard of it
        #| self.model = load_model(self.model_dir, self.dtype, self.device, self.backend.model)
        self.model = self.load_model()
        # <<< ch20
        # <<< ch15
        self.config = self.model.config
        self.tokenizer = load_tokenizer(self.model_dir)
        self.max_seq_len = _check_max_seq_len(self.args.max_seq_len, self.config.max_position_embeddings)
        self.processor = Processor(self.tokenizer, self.model_dir, self.config, self.max_seq_len)
        self.next_uid = 0
        # >>> ch04: one run at a time
        self.serving = False                     # a stream is being consumed
        self.unstarted: dict[int, bool] = {}     # a stream's requests until its run starts: uid -> aborted
        # <<< ch04
        # >>> ch02: the paged cache
        # >>> ch03 replaces ch02: many request slots
        #| self.max_running = 1
        self.max_running = self.args.max_running
        # <<< ch03
        self.runner = self.make_runner()
        # <<< ch02
        # >>> ch13: the decode (or verify) step captured as CUDA graphs (on for CUDA unless cuda_graphs=False)
        if use_cuda_graphs(self.args):
            self.runner.init_graphs(self.max_running)
        # <<< ch13
        # >>> ch17: the prefix cache (on unless prefix_cache=False); with MTP keyed by token pairs (the drafter's K and V)
        if self.args.prefix_cache:
            self.runner.cache.enable_tree(bigram=self.args.mtp_steps > 0)
        # <<< ch17
        # >>> ch04: the scheduler
        self.scheduler = self.make_scheduler()
        # <<< ch04
    # >>> ch04: the scheduler

    def make_scheduler(self) -> Scheduler:
        """The scheduler over the runner; from chapter 18 with the step's budget of prompt tokens; from
        chapter 20 rank 0's shares its inbox with the other ranks' before every iteration, and under DP
        attention it is a DPScheduler, which agrees each step with the other ranks'."""
        # >>> ch20 replaces ch04: under DP attention, a scheduler that agrees each step with the other ranks'
        #| scheduler = Scheduler(self.runner)
        agrees_each_step = self.args.dp_attention
        scheduler = DPScheduler(self.runner, self.group) if agrees_each_step else Scheduler(self.runner)
        # <<< ch20
        # >>> ch18: the step's budget of prompt tokens, and mixed steps
        scheduler.chunked_prefill_size = chunk_size(self.args)
        scheduler.mixed_chunk = self.args.mixed_chunk
        # <<< ch18
        # >>> ch20: rank 0's scheduler shares its inbox with the other ranks' before every iteration
        if self.ranks is not None:
            scheduler.share = lambda items: self.ranks.share(items, scheduler.fingerprint)
        # <<< ch20
        return scheduler
    # <<< ch04
    # >>> ch20: this rank's shard

    def load_model(self) -> Qwen3ForCausalLM:
        """The whole model, or with several ranks this rank's shard of every layer, read as a shard (under
        DP attention: of every MLP, the rest whole)."""
        if self.args.dp_attention:
            return load_dp_model(self.model_dir, self.dtype, self.device, self.group)
        if self.group.tp_size > 1:
            return load_tp_model(self.model_dir, self.dtype, self.device, self.group)
        return load_model(self.model_dir, self.dtype, self.device, self.backend.model)
    # <<< ch20
    # >>> ch02: the paged cache

    def make_runner(self) -> ModelRunner:
        """The model runner with its pool of pages and its request slots (one before chapter 03); from
        chapter 09, with mtp_steps, the runner that speculates with the MTP drafter."""
        sizes = dict(num_pages=self.args.num_pages, page_size=self.args.page_size, max_running=self.max_running,
                     max_seq_len=self.max_seq_len,
                     # >>> ch08: the guards, and the checker for everything that records accesses
                     guards=self.args.resolved_guards(), hazards=HazardChecker() if self.args.hazard_check else None,
                     # <<< ch08
                     # >>> ch15: the attention context of the path chosen at load
                     attention=self.backend.attention,
                     # <<< ch15
                     )
        # >>> ch09: the MTP drafter (a ValueError if the checkpoint has no MTP layer)
        if self.args.mtp_steps:
            return SpecRunner(self.model, self.load_drafter(), self.args.mtp_steps, **sizes)
        # <<< ch09
        # >>> ch19: the n-gram drafter: a lookup on the host, no drafter model
        if self.args.ngram_steps:
            return NgramRunner(self.model, self.args.ngram_steps, **sizes)
        # <<< ch19
        return ModelRunner(self.model, **sizes)
    # <<< ch02
    # >>> ch09: the MTP drafter

    def load_drafter(self) -> MTPLayer:
        """The checkpoint's MTP layer (a ValueError if it has none), from chapter 15 of the class chosen at
        load. From chapter 20, with several ranks, this rank's shard of it: its attention and MLP split as
        the target's layers are, eh_proj and the norms whole, the target's parallel embedding and head
        shared, so that every rank's draft logits are whole and every rank drafts the same tokens. Under DP
        attention the whole layer: each rank drafts for its own requests, with no collective."""
        # >>> ch20: sharded as the target is (parallel/mtp.py); whole under DP attention, its passes each rank's own
        if self.group.tp_size > 1 and not self.args.dp_attention:
            return load_tp_mtp(self.model_dir, self.model, self.group)
        # <<< ch20
        # >>> ch15 replaces ch09: of the class chosen at load
        #| return load_mtp(self.model_dir, self.model)
        return load_mtp(self.model_dir, self.model, self.backend.mtp)
        # <<< ch15
    # <<< ch09

    def encode(self, prompt: Prompt) -> list[int]:
        return self.processor.encode(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.processor.decode(token_ids)

    def make_request(self, prompt: Prompt, params: SamplingParams) -> Req:
        return self.processor.make_request(prompt, params)

    def make_requests(self, prompts: Prompt | list[Prompt], params: Params) -> list[Req]:
        """Check every prompt first (Processor.make_requests); only if all pass do they get their uids."""
        reqs = self.processor.make_requests(prompts, params)
        # >>> ch04: a request that could never fit the page pool is refused now, not left waiting forever
        for req in reqs:
            self.scheduler.check_fits_pool(req)
        # <<< ch04
        # >>> ch19: a request with a grammar gets its own matcher
        for req in reqs:
            req.grammar = self.processor.grammar(req.params)
        # <<< ch19
        for req in reqs:
            req.uid, self.next_uid = self.next_uid, self.next_uid + 1
        return reqs

    def generate(self, prompts: Prompt | list[Prompt], params: Params = None) -> list[RequestOutput]:
        """Complete every prompt. Every prompt is checked before any runs."""
        reqs = self.make_requests(prompts, params)
        # >>> ch04 replaces ch01: the scheduler's loop, which admits requests as room frees up
        #| serve(self, reqs)                    # chapters 01-03: minioverlap/reference/
        for _ in self._serve(reqs):
            pass
        # <<< ch04
        return [self.processor.output(r) for r in reqs]
    # >>> ch04: the scheduler

    def stream(self, prompts: Prompt | list[Prompt], params: Params = None) -> Iterator[Reply]:
        """Yield replies as the scheduler handles them: r.uid, r.token_ids (the new ones), r.finished.
        The prompts are checked before the first reply (ValueError on a bad one)."""
        reqs = self.make_requests(prompts, params)
        self.unstarted.update((req.uid, False) for req in reqs)
        return self._serve(reqs)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Add one request to a run in progress (a `stream` being consumed); returns its uid.
        A bad request raises ValueError here and changes nothing."""
        if not self.serving:
            raise RuntimeError("add_request adds to a run in progress (a stream being consumed); "
                               "to start a run, call stream(...) or generate(...)")
        [req] = self.make_requests([prompt], params)
        self.scheduler.add_request(req)
        return req.uid

    def abort(self, uid: int) -> None:
        """Stop a request: it frees its pages and slot, and its last reply has finish_reason 'abort'.
        A request that has finished is left as it is; a uid no request has been given is refused."""
        number = integral(uid)
        if number is None:
            raise ValueError(f"uid must be an integer, a request's id, got {uid!r}")
        if not 0 <= number < self.next_uid:
            made = f"have uids 0 to {self.next_uid - 1}" if self.next_uid else "are none"
            raise ValueError(f"uid {number} names no request: the requests made so far {made}")
        if number in self.unstarted:             # its stream has not started: the abort waits with it
            self.unstarted[number] = True
        else:
            self.scheduler.abort(number)

    def _serve(self, reqs: list[Req]) -> Iterator[Reply]:
        """Run the scheduler's loop until every request is done, yielding the replies. The run belongs
        to its caller: if the caller leaves early (break, an exception, close, Ctrl-C) or a step fails,
        every request of the run is aborted and freed, and the engine is as good as new."""
        if self.serving:
            raise RuntimeError("a run is in progress (a stream is being consumed): finish or close it first")
        aborted = [req.uid for req in reqs if self.unstarted.pop(req.uid, False)]
        self.scheduler.submit(reqs)
        for uid in aborted:                      # sent before the run started: they reach it now
            self.scheduler.abort(uid)
        self.serving = True
        # >>> ch06 replaces ch04: the loop the options ask for
        #| replies = self.scheduler.run()
        replies = self.scheduler.run(self.args.overlap)
        # <<< ch06
        try:
            yield from replies
        except BaseException:                    # GeneratorExit (the consumer left) included
            self.scheduler.abandon()
            raise
        finally:
            self.serving = False

    @property
    def trace(self) -> Trace:
        """The event list of the last run."""
        return self.scheduler.trace

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every page and request slot is free or owned exactly once."""
        self.scheduler.check_integrity()
    # <<< ch04

    def shutdown(self) -> None:
        """Nothing to stop: the engine runs in the caller's thread, step by step. From chapter 20 the
        other ranks' processes are stopped."""
        # >>> ch20: the other ranks
        if self.ranks is not None:
            self.ranks.shutdown()
            self.ranks = None
        # <<< ch20
    # >>> ch20: each rank's trace

    def rank_traces(self) -> list[Trace]:
        """The trace of the last run on every rank, rank 0's first (one rank: [self.trace]). Between runs."""
        if self.serving:
            raise RuntimeError("rank_traces is asked between runs: a run is in progress (a stream being consumed)")
        return [self.trace] + (self.ranks.traces() if self.ranks is not None else [])
    # <<< ch20


def _engine_args(model: str, options: dict) -> EngineArgs:
    unknown = sorted(set(options) - set(EngineArgs.__dataclass_fields__))
    if unknown:
        raise ValueError(f"LLM has no option {unknown[0]!r}; its options are the fields of EngineArgs: "
                         f"{', '.join(EngineArgs.__dataclass_fields__)}")
    return EngineArgs(model, **options)


def _check_max_seq_len(max_seq_len: int | None, limit: int) -> int:
    if max_seq_len is None:
        return limit
    return _integer("max_seq_len", max_seq_len, f"an integer in [2, {limit}] (the model's context)",
                    lambda n: 2 <= n <= limit)


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
