"""The engine: what `LLM` and every rank of chapter 20 run. It loads the checkpoint and builds, from the
options (EngineArgs), the runner (the model, the page pool, the tables), its graphs, the prefix cache and
the scheduler; it serves nothing itself. `LLM` (llm.py) is its face: requests, runs, aborts. mini-sglang
splits them the same way: its `Engine` beside its `LLM`.
"""

from __future__ import annotations

import torch

from minioverlap.config import EngineArgs
# >>> ch13: CUDA graphs
from minioverlap.config import use_cuda_graphs
# <<< ch13
# >>> ch02: the paged cache
from minioverlap.engine.model_runner import ModelRunner
# <<< ch02
from minioverlap.model.loader import DTYPES, checkpoint_dtype, load_model, load_tokenizer, resolve_model_dir
from minioverlap.model.qwen3 import Qwen3ForCausalLM
from minioverlap.engine.request import Req
from minioverlap.processor import Processor, Prompt
from minioverlap.sampling_params import SamplingParams, _integer
# >>> ch04: the scheduler
from minioverlap.scheduler.scheduler import Scheduler
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
from minioverlap.parallel.group import TPGroup
from minioverlap.parallel.dp_scheduler import DPScheduler
from minioverlap.parallel.rank_scheduler import RankScheduler
from minioverlap.parallel.loader import load_dp_model, load_tp_model
from minioverlap.parallel.mtp import load_tp_mtp
# <<< ch20
# >>> ch21: the pool sized from memory; admission by need, and retraction
from minioverlap.scheduler.retraction import Retraction
from minioverlap.cache.kv_pool import check_tables, default_pages, gib, static_budget
from minioverlap.config import mem_fraction
from minioverlap.engine.forward_batch import ForwardMode
# <<< ch21


class Engine:
    """A checkpoint loaded and its engine built: model, runner, processor, scheduler."""

    def __init__(self, args: EngineArgs) -> None:
        """Load the checkpoint and build the engine that `args` describe: the runner (the model, the page
        pool, the tables), from chapter 13 its graphs, from chapter 17 its prefix cache, and the scheduler
        (from chapter 18 with the step's budget of prompt tokens). From chapter 20 over this rank's shard
        of the weights, once it has joined its group (join_group)."""
        self.args = args
        self.model_dir = resolve_model_dir(args.model)
        self.device = check_device(args.device)
        self.dtype = _resolve_dtype(args.dtype, self.device, self.model_dir)
        # >>> ch20: this rank's place in the group, before anything is loaded
        self.group = self.join_group()
        # <<< ch20
        # >>> ch15: the fast path or the reference, chosen once (kernels=None: on for CUDA, off for CPU)
        self.backend = backend(use_kernels(self.args))
        # <<< ch15
        self.model = self.load_model()
        self.config = self.model.config
        self.tokenizer = load_tokenizer(self.model_dir)
        self.max_seq_len = _check_max_seq_len(self.args.max_seq_len, self.config.max_position_embeddings)
        self.processor = Processor(self.tokenizer, self.model_dir, self.config, self.max_seq_len)
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
        chapter 20, with several ranks, a RankScheduler, which shares its inbox with the other ranks', and
        under DP attention a DPScheduler, which also agrees each step with theirs."""
        # >>> ch20 replaces ch04: with several ranks, a scheduler that agrees with the other ranks'
        #| scheduler = Scheduler(self.runner)
        if self.args.dp_attention:
            scheduler = DPScheduler(self.runner, self.group)
        else:
            scheduler = RankScheduler(self.runner) if self.group.tp_size > 1 else Scheduler(self.runner)
        # <<< ch20
        # >>> ch18: the step's budget of prompt tokens, and mixed steps
        scheduler.chunked_prefill_size = chunk_size(self.args)
        scheduler.mixed_chunk = self.args.mixed_chunk
        # <<< ch18
        # >>> ch21: admission by need, and retraction
        if self.args.new_token_ratio is not None:
            scheduler.retraction = Retraction(scheduler, self.args.new_token_ratio)
        # <<< ch21
        return scheduler
    # <<< ch04
    # >>> ch20: this rank's place in the group

    def join_group(self) -> TPGroup:
        """The group this engine's rank belongs to: here one rank alone. LLM, rank 0, starts the other ranks
        and joins their group; each other rank's engine is given the group it joined (ranks.py)."""
        return TPGroup.single()
    # <<< ch20

    def load_model(self) -> Qwen3ForCausalLM:
        """The whole model; from chapter 15 of the class chosen at load (the fast path's or the reference's);
        from chapter 20, with several ranks, this rank's shard of every layer, read as a shard (under DP
        attention: of every MLP, the rest whole)."""
        # >>> ch20: this rank's shard
        if self.args.dp_attention:
            return load_dp_model(self.model_dir, self.dtype, self.device, self.group)
        if self.group.tp_size > 1:
            return load_tp_model(self.model_dir, self.dtype, self.device, self.group)
        # <<< ch20
        # >>> ch15 replaces ch01: of the class chosen at load
        #| return load_model(self.model_dir, self.dtype, self.device)
        return load_model(self.model_dir, self.dtype, self.device, self.backend.model)
        # <<< ch15
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
                     # >>> ch21: the pool sized by max_total_tokens, or by the memory mem_fraction_static leaves
                     max_total_tokens=self.args.max_total_tokens,
                     pool_bytes=self.pool_bytes(),
                     # <<< ch21
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
    # >>> ch21: the pool sized from memory

    def pool_bytes(self) -> int | None:
        """The bytes the KV pool may take under mem_fraction_static (config.mem_fraction; None: no share, the
        pool is sized otherwise): the share less what stays in use (kv_pool.static_budget)."""
        fraction = mem_fraction(self.args)
        return None if fraction is None else static_budget(fraction, self.device, self.memory_in_use())

    def memory_in_use(self) -> int:
        """What stays in use beside the pool. On a CPU the weights. On a GPU what the device holds once the
        weights are loaded (with the CUDA context and other processes), and the activation peak of the
        largest step, measured; the CUDA graphs, captured once the pool exists, take theirs from the rest."""
        if not self.device.startswith("cuda"):
            return sum(p.numel() * p.element_size() for p in self.model.parameters())
        check_tables(self.max_running, self.max_seq_len, self.device)    # before a step of max_running requests
        tokens = max(chunk_size(self.args) or self.max_seq_len, self.max_running)
        peak = activation_peak(self.model, tokens, self.max_seq_len, self.args.page_size, self.backend.attention)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(torch.device(self.device))
        return total - free + peak

    def pool_summary(self) -> str:
        """One line: the tokens the pool holds, and how many whole max_seq_len contexts."""
        runner = self.runner
        context = runner.allocator.pages_for(self.max_seq_len)
        return (f"KV pool: {runner.pool_tokens} tokens ({runner.usable_pages} pages of {self.args.page_size}, "
                f"{gib(runner.pool_tokens * runner.token_bytes())}): {runner.usable_pages // context} whole "
                f"contexts of max_seq_len={self.max_seq_len}")
    # <<< ch21
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


# >>> ch21: the largest step's activations, measured


@torch.inference_mode()
def activation_peak(model: Qwen3ForCausalLM, tokens: int, max_seq_len: int, page_size: int, attention: type) -> int:
    """Bytes a GPU allocates while the model runs its largest step, beyond what it held before: `tokens`
    prompt tokens, each request's the last of a max_seq_len context (the widest attention), run once over
    a pool just large enough for them, which is then dropped."""
    lens = [max_seq_len] * (tokens // max_seq_len) + [tokens % max_seq_len] * (tokens % max_seq_len > 0)
    runner = ModelRunner(model, num_pages=default_pages(len(lens), max_seq_len, page_size), page_size=page_size,
                         max_running=len(lens), max_seq_len=max_seq_len, attention=attention)
    reqs = [Req(i, [0] * max_seq_len, SamplingParams(max_tokens=1), 1) for i in range(len(lens))]
    for req, n in zip(reqs, lens):
        runner.admit(req)
        req.seq_len = max_seq_len - n               # its K and V before the step are page 0's: read, never used
    batch = runner.batch(ForwardMode.EXTEND, reqs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    runner.logits(batch)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
# <<< ch21


def engine_args(model: str, options: dict) -> EngineArgs:
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


def check_device(device: str) -> str:
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
