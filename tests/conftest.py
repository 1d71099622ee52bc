"""Reference helpers shared by the chapters' tests: the tiny checkpoint, random checkpoints written
by transformers itself, and transformers' own greedy generation to compare against."""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from minioverlap.sampling_params import SamplingParams

TINY = Path(__file__).resolve().parent.parent / "minioverlap" / "checkpoints" / "tiny"
CODE_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n",
                "    for i in range(10):", "x = [1, 2, 3]\nprint("]


# MINIOVERLAP_TEST_DEVICE=cuda runs every engine of the suite on a GPU (in fp32, so that tokens still
# equal the CPU references).
DEVICE = os.environ.get("MINIOVERLAP_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True, scope="session")
def engines_on_test_device():
    if DEVICE == "cpu":
        yield
        return
    from minioverlap import llm

    init = llm.LLM.__init__

    @functools.wraps(init)
    def on_device(self, *args, **kwargs):
        ranks, gpus = kwargs.get("tp_size", 1), torch.cuda.device_count()
        if type(ranks) is int and ranks > gpus and "device" not in kwargs:   # a rank a device: cuda:0 ..
            pytest.skip(f"tp_size={ranks} runs a rank on each of {ranks} GPUs; this machine has {gpus}")
        kwargs.setdefault("device", DEVICE)
        kwargs.setdefault("dtype", "float32")
        init(self, *args, **kwargs)

    llm.LLM.__init__ = on_device
    yield
    llm.LLM.__init__ = init


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


def hf_greedy(model_dir: Path, prompt: list[int], max_tokens: int, eos: tuple[int, ...] = ()) -> list[int]:
    """transformers' Qwen3ForCausalLM.generate, greedy, fp32 on CPU: the reference every chapter matches."""
    from transformers import AutoModelForCausalLM

    model = _hf_model(str(model_dir))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=list(eos) or None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


_HF_CACHE: dict[str, object] = {}


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    if path not in _HF_CACHE:
        logging.set_verbosity_error()   # the tiny checkpoint's MTP tensors are reported as unused
        logging.disable_progress_bar()
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


# A short greedy probe: a bad input must leave the engine giving exactly these tokens as when it was fresh.
PROBE = [[5, 6, 7], "def add(a, b):"]
GREEDY = SamplingParams(max_tokens=4)


def probe_tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROBE, GREEDY)]


def assert_as_fresh(llm, fresh: list[list[int]]) -> None:
    """The engine still gives a fresh engine's greedy tokens (and, from chapter 04, owns nothing it should not)."""
    assert probe_tokens(llm) == fresh
    # >>> ch04: the integrity check
    llm.check_integrity()
    # <<< ch04


def run_example(path: str) -> str:
    """Run an example as the README says, from the stage's root (the repository's, outside a stage),
    and return what it printed. One thread: faster on a shared machine."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {"OMP_NUM_THREADS": "1", **os.environ,
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    run = subprocess.run([sys.executable, path], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return run.stdout


def random_checkpoint(path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, shard_size: str | None = None,
                      norm_noise: float = 0.0, **shape) -> Path:
    """A randomly initialised Qwen3 written by transformers' save_pretrained (its real tensor names).

    A large initializer_range makes the logits peaked, so greedy choices do not hinge on rounding.
    transformers initialises every RMSNorm weight to ones; norm_noise > 0 adds that much Gaussian noise
    to each of them, so that a loader which skipped them (keeping ones) gives other logits.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    defaults = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    initializer_range=0.5, tie_word_embeddings=False, eos_token_id=None)
    model = Qwen3ForCausalLM(Qwen3Config(**(defaults | shape)))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight") and norm_noise:
                weight += norm_noise * torch.randn_like(weight)
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def normal_loop() -> dict:
    """LLM arguments that pin the normal loop: overlap=False from chapter 06, where LLM takes it (from
    chapter 07 the overlap loop is the default); nothing before, where the normal loop is the only one."""
    from minioverlap.config import EngineArgs

    return {"overlap": False} if "overlap" in EngineArgs.__dataclass_fields__ else {}


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): on a small
    machine shared with other work, torch's thread pool spins and a batch of hundreds of requests can
    take ten times as long. Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sampled(cases, kept) -> list:
    """A parametrized sweep of end-to-end runs: the cases in `kept` run in every later chapter's stage too,
    the rest are marked `slow` and run in their own chapter's stage and in the last (tools/README.md). A
    case of several arguments is a tuple."""
    return [case if case in kept else pytest.param(*(case if isinstance(case, tuple) else (case,)),
                                                   marks=pytest.mark.slow) for case in cases]


def window_slack(k: int) -> int:
    """KV positions past a request's last token that its verify windows may need, by hand: the k of its
    last window (chapter 09); from chapter 11, where the host reserves two windows past its count, 2k+1."""
    verify_batch = importlib.import_module("minioverlap.speculative.verify_batch")  # chapter 09 on
    return 2 * k + 1 if hasattr(verify_batch, "reservation_end") else k


def spec_overlap() -> bool:
    """Whether the overlap loop runs MTP (chapter 12 on)."""
    forward_batch = importlib.import_module("minioverlap.engine.forward_batch")     # chapter 02 on
    return "reach" in forward_batch.ForwardBatch.__dataclass_fields__


@contextlib.contextmanager
def no_hang(seconds: int):
    """Fail with TimeoutError instead of hanging, where the platform has SIGALRM (the main thread). A time:
    on a machine shared by many workers it may fire on a run that only waits its turn; where the run is
    the scheduler's loop in this process, bounded_loop's count is the same everywhere. The timer it
    replaces (pytest-timeout's, for the whole test) is set again after, less the time spent."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def fail(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: the run hangs")

    previous = signal.signal(signal.SIGALRM, fail)
    left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - start), 0.001))


@contextlib.contextmanager
def bounded_loop(llm, iterations: int):
    """Fail with RuntimeError instead of looping without end: inside, the scheduler's loop goes round at
    most `iterations` times (its goes_on, chapter 06 on, is asked once a round). A count, not a time, so
    the bound is the same on a GPU shared by many workers, or compiling its kernels, as on an idle
    machine; a wait that never returns is left to pytest-timeout (pyproject.toml)."""
    scheduler, rounds = llm.scheduler, itertools.count(1)
    goes_on = scheduler.goes_on

    def bounded(last):
        if next(rounds) > iterations:
            raise RuntimeError(f"the scheduler's loop went round {iterations} times and goes on: the run never ends")
        return goes_on(last)

    scheduler.goes_on = bounded
    try:
        yield
    finally:
        del scheduler.goes_on


@contextlib.contextmanager
def over_ranks(**options):
    """An LLM over several ranks (LLM(tp_size=N, ...)), shut down when the block ends: its rank processes
    must all have ended with it."""
    from minioverlap import LLM
    llm = LLM(**options)
    procs = list(llm.ranks.procs)
    try:
        yield llm
    finally:
        llm.shutdown()
    assert_no_rank_left(llm, procs)


def assert_no_rank_left(llm, procs: list) -> None:
    """The engine shut down its ranks, and every rank process (`procs`, taken when it started) has ended."""
    assert llm.ranks is None and procs and not [p for p in procs if p.is_alive()]
