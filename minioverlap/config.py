"""The engine's options, in one place: `LLM(model, **options)` makes an EngineArgs of them, checked
before anything is loaded (nano-vllm's Config, SGLang's ServerArgs). From chapter 08 the guards of the
shared tables are a small config of their own, given to the runner and the scheduler when they are built.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
# >>> ch15: is Triton installed
import importlib.util
# <<< ch15

import torch

from minioverlap.sampling_params import _integer
# >>> ch21: a ratio, a share of the memory: real numbers
from minioverlap.sampling_params import _real
# <<< ch21


@dataclass(frozen=True)
class EngineArgs:
    model: str = "tiny"                       # "tiny" (the shipped checkpoint) or a local HF-format directory
    device: str = "cpu"                       # "cpu", "cuda" or "cuda:N"
    dtype: str | torch.dtype | None = None    # None: fp32 on a CPU, the checkpoint's own dtype on a GPU
    max_seq_len: int | None = None           # most tokens of one request, prompt included; None: the model's context
    # >>> ch02: the paged cache
    page_size: int = 16                       # KV slots per page
    # >>> ch21 replaces ch02: or sized by max_total_tokens, or by the memory (below)
    #| num_pages: int | None = None              # pages in the pool, page 0 included; None: room for every slot's full context
    num_pages: int | None = None              # pages in the pool, page 0 included; None: max_total_tokens or the memory (mem_fraction)
    # <<< ch21
    # <<< ch02
    # >>> ch03: batching
    max_running: int = 16                     # request slots: the most requests in flight at once
    # <<< ch03
    # >>> ch06: the overlap loop
    # >>> ch07 replaces ch06: its bugs fixed, the overlap loop is the default
    #| overlap: bool = False                  # True: the overlap loop
    overlap: bool = True                      # False: the normal loop
    # <<< ch07
    # <<< ch06
    # >>> ch08: the fence and the hazard checker
    fence: bool = True                        # False only to show the race the fence prevents
    hazard_check: bool = False                # True: record every access to a shared table; HazardError on a race
    guards: Guards | None = None              # every guard on its own (chapter 08's demonstrations); None: the defaults
    # <<< ch08
    # >>> ch09: MTP speculative decoding
    mtp_steps: int = 0                        # > 0: the MTP layer drafts that many tokens per step
    # <<< ch09
    # >>> ch13: CUDA graphs
    cuda_graphs: bool | None = None           # the decode (or verify) step as graph replays; None: on for CUDA, off for CPU
    # <<< ch13
    # >>> ch15: the fast path
    kernels: bool | None = None               # fused kernels and Triton attention; None: on for CUDA, off for CPU
    # <<< ch15
    # >>> ch17: the prefix cache
    prefix_cache: bool = True                 # False: every prompt is prefilled from scratch
    # <<< ch17
    # >>> ch18: chunked prefill and mixed steps
    chunked_prefill_size: int | None = None   # prompt tokens a step may run; None: the device's (below); -1: no budget
    mixed_chunk: bool = False                 # True: a prefill step carries the running requests' decode rows
    # <<< ch18
    # >>> ch19: the n-gram drafter on the host
    ngram_steps: int = 0                      # > 0: an n-gram lookup in the request's own tokens drafts that many per step
    # <<< ch19
    # >>> ch20: several devices
    tp_size: int = 1                          # > 1: tensor parallelism over that many ranks (NCCL; gloo on a CPU)
    dp_attention: bool = False                # with tp_size > 1: each rank its own requests and attention, the MLP shared
    dist_timeout: float = 60.0                # seconds a collective waits for a stuck peer (not for work: that has no deadline)
    # <<< ch20
    # >>> ch21: the pool sized from memory; admission by need, and retraction
    new_token_ratio: float | None = None      # share of a request's remaining tokens admission counts (SGLang: 0.7); None: all of them
    max_total_tokens: int | None = None       # tokens the KV pool holds (SGLang's --max-total-tokens)
    mem_fraction_static: float | None = None  # share of the device's memory for weights and pool; None: mem_fraction (below)
    # <<< ch21

    def __post_init__(self) -> None:
        """Check every option as it is given, each chapter's by its own rules (CHECKS, at the end of
        this file), so that a bad one is a ValueError naming it, before anything is loaded."""
        for check in CHECKS:
            check(self)
    # >>> ch08: the guards in use

    def resolved_guards(self) -> Guards:
        return self.guards if self.guards is not None else Guards(fence=self.fence)
    # <<< ch08
# >>> ch08: the guards of the shared tables


@dataclass(frozen=True)
class Guards:
    """Which guard orders which write of the tables that both streams touch (chapter 08 says why each
    is needed and what happens without it). The defaults are hazard-free; every other setting exists to
    show a race, which the hazard checker names, or what a guard costs."""
    fence: bool = True                     # the schedule stream waits for each launched step's shared reads
    defer_release: bool = False            # chapter 07's guard: a finished request keeps its slot until its step is handled
    prompt_on_forward_stream: bool = True  # a prefill writes its own prompt into token_pool, on the forward stream

    def __post_init__(self) -> None:
        check_bools(self)


def check_guards(args: EngineArgs) -> None:
    """The fence is a guard: fence=False and an explicit Guards(...) would say it twice."""
    if args.guards is not None and not args.fence:
        raise ValueError("fence=False and guards=Guards(...) both given: pass Guards(fence=False) alone")
# <<< ch08


def check_bools(args: EngineArgs | Guards) -> None:
    """A bool field is True or False, not 1 or "yes"."""
    for f in fields(args):
        if f.type == "bool":
            check_bool(f.name, getattr(args, f.name))


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
# >>> ch02: the paged cache


def check_sizes(args: EngineArgs) -> None:
    """page_size >= 1, num_pages None or >= 2 (page 0 is never handed out), max_running >= 1; kept as ints."""
    sizes = {"page_size": _integer("page_size", args.page_size, "an integer >= 1", lambda n: n >= 1)}
    if args.num_pages is not None:
        sizes["num_pages"] = _integer("num_pages", args.num_pages, "an integer >= 2", lambda n: n >= 2)
    # >>> ch03: batching
    sizes["max_running"] = _integer("max_running", args.max_running, "an integer >= 1", lambda n: n >= 1)
    # <<< ch03
    for name, value in sizes.items():
        object.__setattr__(args, name, value)    # the one way to set a field of a frozen dataclass
# <<< ch02
# >>> ch09: MTP

MAX_MTP_STEPS = 8                      # drafts per step; beyond a few, almost none are accepted


def check_mtp_steps(args: EngineArgs) -> None:
    """mtp_steps: an integer (not a bool) in [0, MAX_MTP_STEPS] (chapters 09-11: with overlap=False only)."""
    _integer("mtp_steps", args.mtp_steps, f"an integer in [0, {MAX_MTP_STEPS}]", lambda k: 0 <= k <= MAX_MTP_STEPS)
    # >>> ch12 removes ch09: speculative decoding runs in the overlap loop too
    #| if args.mtp_steps and args.overlap:
    #|     raise ValueError(f"mtp_steps={args.mtp_steps} runs in the normal loop: pass overlap=False as well "
    #|                      "(speculative decoding in the overlap loop is chapter 12's)")
    # <<< ch12
# <<< ch09
# >>> ch13: CUDA graphs


def check_cuda_graphs(args: EngineArgs) -> None:
    """cuda_graphs: None (on for CUDA, off for CPU), True or False; True on a device without graphs is refused."""
    if args.cuda_graphs is not None:
        check_bool("cuda_graphs", args.cuda_graphs)
    if args.cuda_graphs and not str(args.device).startswith("cuda"):
        raise ValueError(f"cuda_graphs=True needs a CUDA device, got device={args.device!r} "
                         "(leave cuda_graphs=None: off for a CPU)")


def use_cuda_graphs(args: EngineArgs) -> bool:
    """Whether the engine captures graphs: as asked, or by default on a GPU."""
    # >>> ch20 replaces ch13: and not with several ranks (check_tp_size)
    #| return args.cuda_graphs if args.cuda_graphs is not None else str(args.device).startswith("cuda")
    return args.cuda_graphs if args.cuda_graphs is not None else str(args.device).startswith("cuda") and args.tp_size == 1
    # <<< ch20
# <<< ch13
# >>> ch15: the fast path


def check_kernels(args: EngineArgs) -> None:
    """kernels: None (on for CUDA, off for CPU), True or False. True on a CPU runs the kernels in
    Triton's interpreter: the same kernels, slowly (how the tests check them without a GPU)."""
    if args.kernels is not None:
        check_bool("kernels", args.kernels)
    if use_kernels(args) and importlib.util.find_spec("triton") is None:
        raise ValueError(f"kernels={args.kernels} on device={args.device!r} needs the triton package, which is not "
                         "installed (pip install triton, on Linux), or pass kernels=False")


def use_kernels(args: EngineArgs) -> bool:
    """Whether the engine takes the fast path: as asked, or by default on a GPU."""
    # >>> ch20 replaces ch15: and not with several ranks (check_tp_size)
    #| return args.kernels if args.kernels is not None else str(args.device).startswith("cuda")
    return args.kernels if args.kernels is not None else str(args.device).startswith("cuda") and args.tp_size == 1
    # <<< ch20
# <<< ch15

# >>> ch18: chunked prefill and mixed steps

GPU_CHUNK = 8192     # SGLang's on an H100 or H200: a step of that many tokens keeps the GPU compute-bound
CPU_CHUNK = 64       # a CPU's step grows with every token: chapter 18 measured 32, 64 and 128 (64: the middle)


def check_chunking(args: EngineArgs) -> None:
    """chunked_prefill_size: None, -1 or an integer >= 1; mixed_chunk: not with MTP (chapter 18 says why)."""
    if args.chunked_prefill_size is not None:
        size = _integer("chunked_prefill_size", args.chunked_prefill_size, "an integer >= 1, or -1 (every prompt whole)",
                        lambda n: n >= 1 or n == -1)
        object.__setattr__(args, "chunked_prefill_size", size)
    if args.chunked_prefill_size not in (None, -1) and not args.resolved_guards().prompt_on_forward_stream:
        raise ValueError(f"chunked_prefill_size={args.chunked_prefill_size} needs Guards(prompt_on_forward_stream=True): "
                         "a chunk's step writes its sampled token over the next chunk's first prompt token, which "
                         "the next step must write again (with the prompt written at admission, nothing would)")
    if args.mixed_chunk and args.mtp_steps:
        raise ValueError(f"mixed_chunk=True with mtp_steps={args.mtp_steps}: a verify step runs a window of "
                         f"{args.mtp_steps + 1} tokens per request and its drafter's passes, a prefill one pass; "
                         "they do not mix (nor in SGLang): pass one of them")


def chunk_size(args: EngineArgs) -> int | None:
    """The step's budget of prompt tokens (None: no budget). By default the device's; none where chapter 08's
    demonstration writes the prompt at admission (a chunk's sampled token would overwrite the next chunk's)."""
    if args.chunked_prefill_size is None and not args.resolved_guards().prompt_on_forward_stream:
        return None
    if args.chunked_prefill_size is None:
        return GPU_CHUNK if str(args.device).startswith("cuda") else CPU_CHUNK
    return None if args.chunked_prefill_size == -1 else args.chunked_prefill_size
# <<< ch18
# >>> ch19: the n-gram drafter on the host

MAX_NGRAM_STEPS = 16                   # drafts per step; a lookup rarely matches further than a few


def check_ngram_steps(args: EngineArgs) -> None:
    """ngram_steps: an integer (not a bool) in [0, MAX_NGRAM_STEPS]; one drafter at a time, and no mixed
    steps (a verify window does not mix with prompt rows, as with MTP)."""
    steps = _integer("ngram_steps", args.ngram_steps, f"an integer in [0, {MAX_NGRAM_STEPS}]",
                     lambda k: 0 <= k <= MAX_NGRAM_STEPS)
    object.__setattr__(args, "ngram_steps", steps)
    if args.ngram_steps and args.mtp_steps:
        raise ValueError(f"ngram_steps={args.ngram_steps} and mtp_steps={args.mtp_steps}: one drafter at a time "
                         "(the n-gram lookup or the MTP layer): pass one of them")
    if args.ngram_steps and args.mixed_chunk:
        raise ValueError(f"mixed_chunk=True with ngram_steps={args.ngram_steps}: every decode step is a verify "
                         f"step, a window of {args.ngram_steps + 1} tokens per request, and a prefill's rows do not "
                         "mix with windows: pass one of them")
# <<< ch19
# >>> ch20: several devices

MAX_TP_SIZE = 8                        # ranks: one process and one device each


def check_tp_size(args: EngineArgs) -> None:
    """tp_size: an integer in [1, MAX_TP_SIZE]. What has no tensor-parallel form here yet is refused with
    it: the fast path (its merged projections are the whole model's) and CUDA graphs (gloo's collectives
    cannot be captured; NCCL's are untested here). MTP's drafter is sharded as the target is
    (parallel/mtp.py), so mtp_steps is not refused."""
    tp = _integer("tp_size", args.tp_size, f"an integer in [1, {MAX_TP_SIZE}]", lambda n: 1 <= n <= MAX_TP_SIZE)
    object.__setattr__(args, "tp_size", tp)
    unsharded = {"kernels": args.kernels, "cuda_graphs": args.cuda_graphs}
    given = [f"{name}={value}" for name, value in unsharded.items() if value]
    if tp > 1 and given:
        raise ValueError(f"tp_size={tp} with {given[0]}: tensor parallelism runs the reference path, eagerly, "
                         "for now: pass tp_size=1 or leave that option out")


def check_dp_attention(args: EngineArgs) -> None:
    """dp_attention needs several ranks."""
    if args.dp_attention and args.tp_size == 1:
        raise ValueError("dp_attention=True needs tp_size > 1 (the ranks that share the MLP), got tp_size=1")


def check_dist_timeout(args: EngineArgs) -> None:
    """dist_timeout: a positive number of seconds."""
    timeout = args.dist_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"dist_timeout must be a positive number of seconds, got {timeout!r}")
# <<< ch20
# >>> ch21: admission by need; the pool sized from memory


def check_new_token_ratio(args: EngineArgs) -> None:
    """new_token_ratio: None, or a real in (0, 1]; its retractions refill a request's outputs, which a
    prefill writes into token_pool itself (Guards(prompt_on_forward_stream=True))."""
    if args.new_token_ratio is None:
        return
    ratio = _real("new_token_ratio", args.new_token_ratio, "a real number in (0, 1], or None", lambda r: 0 < r <= 1)
    object.__setattr__(args, "new_token_ratio", ratio)
    if not args.resolved_guards().prompt_on_forward_stream:
        raise ValueError(f"new_token_ratio={ratio} needs Guards(prompt_on_forward_stream=True): a retracted request "
                         "fills its outputs again, which its prefill must write into token_pool (written at "
                         "admission, only the prompt would be)")

GPU_MEM_FRACTION = 0.88   # SGLang's share on a large GPU; the rest for the activations and the CUDA graphs


def check_pool_size(args: EngineArgs) -> None:
    """max_total_tokens: an integer >= page_size; mem_fraction_static: a real number in (0, 1); each sizes
    the pool, as num_pages does: one of the three at most."""
    if args.max_total_tokens is not None:
        tokens = _integer("max_total_tokens", args.max_total_tokens, f"an integer >= page_size = {args.page_size}",
                          lambda n: n >= args.page_size)
        object.__setattr__(args, "max_total_tokens", tokens)
    if args.mem_fraction_static is not None:
        fraction = _real("mem_fraction_static", args.mem_fraction_static, "a real number in (0, 1)", lambda f: 0 < f < 1)
        object.__setattr__(args, "mem_fraction_static", fraction)
    given = [f"{name}={getattr(args, name)}" for name in ("num_pages", "max_total_tokens", "mem_fraction_static")
             if getattr(args, name) is not None]
    if len(given) > 1:
        raise ValueError(f"{given[0]} and {given[1]}: each sizes the KV pool: pass one of them")
    if args.mem_fraction_static is not None and args.tp_size > 1:
        raise ValueError(f"mem_fraction_static={args.mem_fraction_static} with tp_size={args.tp_size}: each rank would "
                         "size its pool from the memory it sees, and the ranks' pools must be alike: pass "
                         "max_total_tokens or num_pages")


def mem_fraction(args: EngineArgs) -> float | None:
    """The share of the device's memory for the weights and the KV pool: as given; on one GPU with no other
    size given GPU_MEM_FRACTION; else None (a CPU's pool by default holds every slot's whole context)."""
    others = (args.num_pages, args.max_total_tokens)
    on_one_gpu = str(args.device).startswith("cuda") and args.tp_size == 1
    if args.mem_fraction_static is None and on_one_gpu and others == (None, None):
        return GPU_MEM_FRACTION
    return args.mem_fraction_static
# <<< ch21


CHECKS = [
    check_bools,
    # >>> ch02: the paged cache
    check_sizes,
    # <<< ch02
    # >>> ch08: the fence is a guard
    check_guards,
    # <<< ch08
    # >>> ch09: MTP
    check_mtp_steps,
    # <<< ch09
    # >>> ch13: CUDA graphs
    check_cuda_graphs,
    # <<< ch13
    # >>> ch15: the fast path
    check_kernels,
    # <<< ch15
    # >>> ch18: chunked prefill and mixed steps
    check_chunking,
    # <<< ch18
    # >>> ch19: the n-gram drafter on the host
    check_ngram_steps,
    # <<< ch19
    # >>> ch20: several devices
    check_tp_size,
    check_dp_attention,
    check_dist_timeout,
    # <<< ch20
    # >>> ch21: admission by need
    check_new_token_ratio,
    check_pool_size,
    # <<< ch21
]
