"""Chapter 21: the KV pool sized from what is given. max_total_tokens gives it that many tokens (whole
pages, page 0 beside them); mem_fraction_static the pages its share of the memory leaves once the weights
are in; num_pages still wins, and two of them at once are refused. A pool sized so must hold one
max_seq_len context. The engine says at start what its pool holds, and the command line's flags reach it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import assert_as_fresh, probe_tokens
from minioverlap import LLM, SamplingParams
from minioverlap.cache.kv_pool import device_memory, pool_pages, static_budget
from minioverlap.cli import engine_options, parser
from minioverlap.config import GPU_MEM_FRACTION, EngineArgs, mem_fraction
from serving import Server


@pytest.fixture(scope="module")
def engine() -> tuple[LLM, list[list[int]]]:
    """One engine for the module (the default pool), and its greedy tokens while it is fresh."""
    llm = LLM(model="tiny")
    return llm, probe_tokens(llm)


@pytest.mark.parametrize("page_size, max_total_tokens, pages", [(16, 2048, 129), (4, 1030, 259), (16, 64, 5)])
def test_max_total_tokens_gives_the_pool_that_many_tokens(engine, page_size, max_total_tokens, pages):
    """ceil(max_total_tokens / page_size) pages, and page 0; the engine gives the default pool's tokens."""
    llm = LLM(model="tiny", page_size=page_size, max_total_tokens=max_total_tokens, max_seq_len=64)
    assert llm.runner.allocator.num_pages == pages
    assert llm.runner.pool_tokens == (pages - 1) * page_size >= max_total_tokens
    assert llm.runner.kv_pool.k[0].shape[0] == pages * page_size
    assert probe_tokens(llm) == engine[1]


def test_a_request_as_long_as_the_context_runs_in_a_pool_of_one_context():
    """max_total_tokens = max_seq_len: one request that fills the whole context runs to its end (nothing
    refuses it, nothing waits forever)."""
    llm = LLM(model="tiny", max_total_tokens=64, max_seq_len=64)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=60, ignore_eos=True))[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"
    llm.check_integrity()


FIELD = r"mem_fraction_static must be a real number in \(0, 1\), got "


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_total_tokens=True), r"max_total_tokens must be an integer >= page_size = 16, got True"),
    (dict(max_total_tokens=8), r"max_total_tokens must be an integer >= page_size = 16, got 8"),
    (dict(max_total_tokens=2048.0), r"max_total_tokens must be an integer >= page_size = 16, got 2048\.0"),
    (dict(page_size=32, max_total_tokens=16), r"max_total_tokens must be an integer >= page_size = 32, got 16"),
    (dict(mem_fraction_static=0), FIELD + "0"),
    (dict(mem_fraction_static=1.0), FIELD + r"1\.0"),
    (dict(mem_fraction_static=-0.5), FIELD + r"-0\.5"),
    (dict(mem_fraction_static=float("nan")), FIELD + "nan"),
    (dict(mem_fraction_static=True), FIELD + "True"),
    (dict(mem_fraction_static="0.5"), FIELD + "'0.5'"),
    (dict(num_pages=100, max_total_tokens=1024), r"num_pages=100 and max_total_tokens=1024: each sizes the KV pool: pass one"),
    (dict(num_pages=100, mem_fraction_static=0.5), r"num_pages=100 and mem_fraction_static=0.5: .* pass one"),
    (dict(max_total_tokens=1024, mem_fraction_static=0.5), r"max_total_tokens=1024 and mem_fraction_static=0.5: .* pass one"),
    (dict(max_total_tokens=100), r"max_total_tokens=100 gives a KV pool of 112 tokens, less than one context of "
                                 r"max_seq_len=1024 tokens \(65 pages of 16, page 0 included\): pass a larger max_total_tokens"),
    (dict(mem_fraction_static=0.5, tp_size=2), r"mem_fraction_static=0.5 with tp_size=2: .* the ranks' pools must be "
                                                r"alike: pass max_total_tokens or num_pages"),
    (dict(mem_fraction_static=1e-9), r"mem_fraction_static, whose share less what is in use leaves -.* GiB for the KV "
                                     r"pool, gives a KV pool of 0 tokens, less than one context of max_seq_len=1024"),
])
def test_a_bad_pool_size_is_refused_naming_field_value_and_limit(engine, kwargs, message):
    """A ValueError before anything runs; the engine already running is untouched."""
    llm, fresh = engine
    with pytest.raises(ValueError, match=message):
        LLM(model="tiny", **kwargs)
    assert_as_fresh(llm, fresh)


def test_numpy_sizes_are_sizes():
    """A NumPy integer and float are kept as an int and a float."""
    args = EngineArgs(max_total_tokens=np.int64(2048))
    assert type(args.max_total_tokens) is int and args.max_total_tokens == 2048
    args = EngineArgs(mem_fraction_static=np.float32(0.5))
    assert type(args.mem_fraction_static) is float and args.mem_fraction_static == 0.5


def test_num_pages_still_sizes_the_pool_and_a_request_too_large_for_it_is_refused():
    """num_pages is the pool's size as given, even below one context (chapter 02's); a request that could
    never fit it is refused as it comes, with what it needs, not left waiting."""
    llm = LLM(model="tiny", page_size=4, num_pages=4)
    assert llm.runner.allocator.num_pages == 4 and llm.runner.pool_tokens == 12
    with pytest.raises(ValueError, match=r"prompt \+ max_tokens = 14 tokens need 4 pages; the pool has 3"):
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids) == 8
    llm.check_integrity()


def test_mem_fraction_static_on_a_cpu_is_a_share_of_the_physical_memory_less_the_weights():
    """The share that leaves room for 40 pages once the weights are in gives a pool of those pages:
    (fraction x physical memory - weights) // bytes per page, page 0 among them."""
    probe = LLM(model="tiny", device="cpu", max_total_tokens=64, max_seq_len=64)
    weights = sum(p.numel() * p.element_size() for p in probe.model.parameters())
    page_bytes = probe.args.page_size * probe.runner.token_bytes()
    memory = device_memory("cpu")[0]
    fraction = (weights + 40.5 * page_bytes) / memory
    llm = LLM(model="tiny", device="cpu", mem_fraction_static=fraction, max_seq_len=64)
    expected = (int(fraction * memory) - weights) // page_bytes
    assert expected == 40
    assert llm.runner.allocator.num_pages == expected
    assert expected == pool_pages(10**9, 16, page_bytes, pool_bytes=static_budget(fraction, "cpu", weights))
    assert probe_tokens(llm) == probe_tokens(probe)


def test_a_pool_from_memory_is_no_larger_than_the_worst_case():
    """A share that would leave more than every slot's whole context gives that: beyond it the pool's pages
    would hold nothing a request of max_seq_len needs (max_total_tokens asks for more)."""
    llm = LLM(model="tiny", device="cpu", mem_fraction_static=0.5, max_running=2, max_seq_len=64)
    assert llm.runner.allocator.num_pages == 2 * 4 + 1


def test_the_default_fraction_is_a_gpu_s_alone():
    """None: GPU_MEM_FRACTION on one GPU with no other size given; on a CPU the worst case, as before."""
    assert mem_fraction(EngineArgs(device="cuda", kernels=False)) == GPU_MEM_FRACTION == 0.88
    assert mem_fraction(EngineArgs(device="cuda", kernels=False, mem_fraction_static=0.5)) == 0.5
    assert mem_fraction(EngineArgs(device="cuda", kernels=False, max_total_tokens=4096)) is None
    assert mem_fraction(EngineArgs(device="cuda", kernels=False, num_pages=100)) is None
    assert mem_fraction(EngineArgs(device="cpu")) is None
    assert mem_fraction(EngineArgs(device="cpu", mem_fraction_static=0.25)) == 0.25


def test_the_start_line_states_the_tokens_and_the_contexts():
    """The tokens the pool holds, its pages, and the whole contexts that fit, each a context's pages."""
    llm = LLM(model="tiny", max_total_tokens=2000, max_seq_len=256)
    assert llm.pool_summary().startswith("KV pool: 2000 tokens (125 pages of 16, ")
    assert llm.pool_summary().endswith("): 7 whole contexts of max_seq_len=256")
    odd = LLM(model="tiny", max_total_tokens=2048, max_seq_len=100)
    assert odd.pool_summary().endswith("): 18 whole contexts of max_seq_len=100")   # 7 pages a context, not 100 tokens
    default = LLM(model="tiny", max_running=3, page_size=4)
    assert default.pool_summary().endswith(f"): 3 whole contexts of max_seq_len=1024")
    assert default.runner.pool_tokens == 3 * 1024


@pytest.mark.parametrize("command", [["generate", "hello"], ["serve"], ["trace"]])
def test_the_flags_reach_the_engine_options(command):
    """--max-total-tokens and --mem-fraction-static become the options of their names; left out, neither is there."""
    args = parser().parse_args([*command, "--max-total-tokens", "4096"])
    assert engine_options(args)["max_total_tokens"] == 4096
    args = parser().parse_args([*command, "--mem-fraction-static", "0.5"])
    assert engine_options(args)["mem_fraction_static"] == 0.5
    options = engine_options(parser().parse_args(command))
    assert "max_total_tokens" not in options and "mem_fraction_static" not in options


def test_an_engine_from_the_flags_has_the_pool_they_ask_for():
    """3000 tokens: 188 pages of 16."""
    llm = LLM(**engine_options(parser().parse_args(["generate", "hello", "--max-total-tokens", "3000"])))
    assert llm.runner.pool_tokens == 3008


@pytest.mark.process
def test_generate_prints_the_pool_on_stderr_and_the_completion_alone_on_stdout():
    """The start line goes to stderr: stdout stays the completion (the chapters' transcripts show it). A bad
    value is an error line, exit 2."""
    run = subprocess.run([sys.executable, "-m", "minioverlap", "generate", "def f(x):", "--max-tokens", "4",
                          "--max-total-tokens", "3000"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "KV pool: 3008 tokens (188 pages of 16, " in run.stderr
    assert "): 2 whole contexts of max_seq_len=1024" in run.stderr
    assert "KV pool" not in run.stdout and "(4 tokens, finish_reason=length)" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "minioverlap", "generate", "def f(x):", "--mem-fraction-static", "2"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "mem_fraction_static must be a real number in (0, 1), got 2.0" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.process
def test_serve_prints_the_pool_before_it_serves():
    """The scheduler process says what its pool holds (on stderr) before the server says it serves."""
    server = Server("--max-total-tokens", "3000", "--max-seq-len", "512")
    code, output = server.stop()
    assert code == 0, output
    pool = next(line for line in output.splitlines() if "KV pool:" in line)
    assert pool.startswith("minioverlap: KV pool: 3008 tokens (188 pages of 16, ")
    assert pool.endswith("): 5 whole contexts of max_seq_len=512")
    assert output.index("KV pool:") < output.index("minioverlap: serving")
