"""Chapter 16's serving benchmark: `minioverlap serve` under a stream of requests, as SGLang's bench_serving.

    python tools/bench_serving.py                                      # normal and overlap, 64 requests at once
    python tools/bench_serving.py --dataset generated-shared-prefix --configs normal,normal+cache --request-rate 4
    python tools/bench_serving.py --configs normal,overlap,normal+mtp2,overlap+mtp2 --request-rate 8
    python tools/bench_serving.py --configs normal,overlap --num-requests 24 --request-rate 8 --json /tmp/bs.json
    python tools/bench_serving.py --compare-ttft --configs normal,overlap,overlap+ftf --num-requests 10
    python tools/bench_serving.py --shape 8b --device cuda --configs overlap,overlap+ftf --request-rate 16
    python tools/bench_serving.py --dataset long-among-short --configs overlap,overlap+chunk64,overlap+chunk64+mixed
    python tools/bench_serving.py --url http://127.0.0.1:8000          # a server that is running already
    python tools/bench_serving.py --report /tmp/bs.json                # no run: the table of a recorded one

Each configuration of --configs is a server of its own: `normal`, `overlap`, `normal+mtp2`, `overlap+ftf`,
`overlap+mtp2+ftf`, `overlap+cache`, `overlap+mtp2+ftf+cache`, `overlap+chunk64`, `overlap+chunk64+mixed`
mean `minioverlap serve --loop L [--mtp K] [--first-tokens-first] --prefix-cache|--no-prefix-cache
--chunked-prefill-size N|-1 [--enable-mixed-chunk]` (with --model, --device and --max-running), in that
order of suffixes; `+ftf`, the overlap loop handling a prefill before it launches the next step so that
the first token goes out sooner, is the overlap loop's alone (the normal loop handles every step before
the next). Chapter 17's prefix cache is on only where the configuration asks for it with `+cache`: every
other server is started with --no-prefix-cache (though the cache is serve's default), so that a
configuration means what it meant before chapter 17 and the runs recorded then (chapter 16's, set beside
transformers, which computes every prompt) stay comparable. Likewise chapter 18's chunked prefill: `+chunkN`
gives a step a budget of N prompt tokens (--chunked-prefill-size N: a longer prompt is prefilled in chunks)
and `+mixed` after it lets a chunk's step carry the running requests' decode rows (--enable-mixed-chunk;
not with +mtpK, which the server refuses); every server without `+chunkN` is started with
--chunked-prefill-size -1, every prompt whole (though serve's default is 64 on a CPU, 8192 on a GPU), so
that the configurations recorded before chapter 18 keep their meaning. A server is started on a free port of
127.0.0.1, waited for (GET /health), sent the workload, then checked (GET /integrity once it is idle:
every page and slot free again), stopped with SIGTERM and required to exit with 0, leaving no process of
its session behind. One configuration runs at a time, except with --compare-ttft. With --url the one
server there is measured, with its own settings of the cache and of chunked prefill, and neither started
nor stopped.

The model is --model (default tiny, the shipped one), or with --shape 0.6b|8b a random-weight bf16 Qwen3
checkpoint of that real shape: tools/bench.py's make_checkpoint, made once under --cache-dir and reused
(bench.py builds it on a CUDA GPU, or on the CPU where there is none).

The workload is drawn once from random.Random(--seed), the same for every configuration; each request asks
for its output length with ignore_eos, greedy (temperature 0). --dataset (or SGLang's spelling,
--dataset-name) chooses it, by the names of SGLang's datasets:

  random (the default): --num-requests prompts, each of a length drawn from --input-len, asking for an
    output length drawn from --output-len. For a model with a tokenizer.json a prompt is a passage of the
    book's own prose (chapters/*.md, HTML comments removed) that starts at a random word and is that many
    words long; for one without (the random checkpoints of --shape) it is a list of that many token ids,
    each drawn from [10, vocab_size) of its config.json, which the server takes as `prompt` as it is.
    (SGLang's random cuts its prompts from ShareGPT's conversations instead, and counts tokens.)
  generated-shared-prefix: SGLang's (bench_serving --dataset-name generated-shared-prefix, with its
    options): --gsp-num-groups groups of --gsp-prompts-per-group requests. Each group has a system prompt
    of --gsp-system-prompt-len, made once (a passage of the book, or token ids, as above); each request
    is that system prompt, a blank line (two newlines, as SGLang joins them; token ids simply follow) and
    a question of its own of --gsp-question-len, and asks for --gsp-output-len tokens. The lengths are in
    words (SGLang's are in tokens), or tokens for a model without a tokenizer; with --gsp-range-ratio R
    below 1 each is drawn from [max(int(N*R), 1), N] (a system prompt's once for its group), as SGLang
    draws them; the default 1 takes N. The requests are then shuffled, so that the groups interleave, as
    SGLang does unless --gsp-ordered, which keeps them group after group. A group's prompts share their
    first tokens, not only their text: byte-level BPE cuts words apart at whitespace before it merges, so
    the system prompt's tokens (and the blank line's) do not depend on the question after it. Its warm-up
    request (--warmup) is not the first request, as the random dataset's is, but one of the same lengths
    whose system prompt is no group's (random.Random("warmup SEED")): every group's prefix is cold when
    the timed requests start, and the first of each group to arrive computes it.
  long-among-short (ours, for chapter 18): --las-streams short streaming requests, each a prompt of
    --las-stream-input-len (words, or tokens without a tokenizer) asking for --las-stream-output-len tokens,
    all sent at 0 s; and --las-long long prompts of --las-long-len tokens, each asking for
    --las-long-output-len, the first sent at --las-start s and the others --las-interval s apart, while the
    streams run. A long prompt is N token ids, or a passage of the book from a random word, cut at the last
    whole word within N tokens as the model's tokenizer.json counts them (the server counts alike; drawn
    again where that is fewer than N - 16, before a table's border of hundreds of tokens): a length near the
    context must be in tokens, and the book's words average two tokens or more of the tiny model's. Its
    prefill is the gap it opens in every stream: the table shows, in place of TPOT and latency, the ITL of
    the streams alone (median, p99, the worst gap) and the long prompts' median TTFT. Its warm-up request is
    a long prompt of its own (random.Random("warmup SEED")), so that the first big prefill is untimed too.
    Its arrival times are its own: not with --request-rate or --compare-ttft. They are seconds, and the
    defaults fit the tiny model on a CPU: on a faster device the streams must be longer, or the long prompts
    closer, for them to come while the streams run (below the table, a warning for each run where one came
    after the last stream had ended).

The requests arrive as a Poisson process of --request-rate requests/s (exponential gaps), or all at once
(`inf`). With --compare-ttft they are sent one at a time, each when the one before has finished, so every
time to first token is a lone request's; the servers of every configuration run together and take turns,
request by request in a rotating order, so that a slow spell of a shared machine falls on all of them (a
server's duration is then the sum of its requests' latencies, the time it was serving). Every request is
a streamed POST /v1/completions (one httpx.AsyncClient), with stream_options.include_usage so that its
last chunk counts its tokens. --warmup requests go first to each server, untimed.

Per request, from the client's clock, on chunks, not on text: the server sends a chunk per engine step
with that step's tokens (several with MTP), but its text may be empty, while a character is not complete
yet, and always is for a checkpoint without tokenizer.json. So TTFT is the time from sending to the first
chunk that carries a choice (a completion has no role chunk; the usage chunk has none); ITL the gaps
between such chunks (a time per chunk: per step); end-to-end latency, from sending to the end of the
stream; TPOT, (latency - TTFT) / (output tokens - 1), a time per token whatever a chunk carries. SGLang's
bench_serving counts from the first chunk with non-empty text; on this server every such chunk (but an
aborted request's last) carries at least one token, so the two agree except where text is held back. From
the usage chunk, its prompt tokens and usage.prompt_tokens_details.cached_tokens, OpenAI's count of the
prompt tokens the server found in its prefix cache (chapter 17: whole pages, never the prompt's last
token). Per configuration: the duration (the first send to the last request's end), requests/s and
output tokens/s over it, TTFT, TPOT, ITL and latency as mean, median and p99 (ITL over every gap of every
request), output tokens per chunk (above 1 with MTP), the hit rate (the sum of cached_tokens over the sum
of prompt_tokens, over the timed requests that completed; none where the server does not report
cached_tokens); each configuration's median TTFT and output tokens/s against the first configuration's
(with --compare-ttft also the median of the per-request ratios: request i ran on both servers back to
back, so a slow spell cancels out), and each `+cache` configuration's against the same one without the
cache where that ran too. Every figure is a time or a token count of the run, or a ratio of two such.
Below the table, the host's load average before and after each run: on a shared machine it says how far
to trust the run (another program's work lengthens every time).

--json FILE records the run in a form a chapter can quote: at the top "device", "model", "mode" ("rate R",
"all at once", "one at a time" or long-among-short's "streams at 0 s, long prompts from S s every I s") and
"results", one flat dict per configuration, in --configs' order: "config" (its name, as "overlap+ftf") and
numbers, "req_s", "out_tok_s", "ttft_ms_mean", "ttft_ms_median", "ttft_ms_p99", "tpot_ms_median",
"tpot_ms_p99", "itl_ms_median", "itl_ms_p99", "e2e_ms_median", "tok_per_chunk", "hit_rate", "completed",
"requests" and a few more (durations, token counts, "cached_tokens"; for long-among-short
"stream_itl_ms_mean", "_median", "_p99", "_max", "long_ttft_ms_mean", "_median", "_p99" and the same of
"long_itl_ms": the decode steps that hold a long prompt); beside them
"workload" (the dataset, its arguments, every request drawn, a shared-prefix one with its group, a
long-among-short one with its role, "stream" or "long", and that dataset's warm-up request) and "runs", per
configuration its server (command, exit code, integrity report, load) and every request's raw numbers
("per_request").
--report FILE prints the table from such a file again (a record made before chapter 17 has no hit rate).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CONFIG = re.compile(r"^(?P<loop>normal|overlap)(?:\+mtp(?P<mtp>[1-9]\d*))?(?P<ftf>\+ftf)?(?P<cache>\+cache)?"
                    r"(?:\+chunk(?P<chunk>[1-9]\d*))?(?P<mixed>\+mixed)?$")
RANDOM, GSP = "random", "generated-shared-prefix"          # the datasets, by SGLang's names
LAS = "long-among-short"                                   # and one of our own (chapter 18)
SHIPPED = ROOT / "minioverlap" / "checkpoints"           # the shipped models by name, as the loader finds them
LONG_SLACK = 16                                      # tokens a long prompt may fall short of --las-long-len
DEFAULT_CACHE = "~/.cache/minioverlap-bench"         # --shape's checkpoints, kept for later runs
DEFAULTS = {                                         # each dataset's options: None when not given, checked, then these
    "num_requests": 64, "input_len": (8, 64), "output_len": (16, 64),
    # SGLang's defaults are 64 x 16 prompts, 2048 + 128 tokens in, 256 out: more than the tiny model's context
    "gsp_num_groups": 8, "gsp_prompts_per_group": 8, "gsp_system_prompt_len": 160, "gsp_question_len": 16,
    "gsp_output_len": 32, "gsp_range_ratio": 1.0, "gsp_ordered": False,
    # long-among-short's, for the tiny model on a CPU (a decode step of 12 streams 10 to 16 ms, a long prompt's
    # prefill 0.15 s or more): the streams still run when the last long prompt comes, and the gaps the long
    # prompts open in them, 5 x 12 of 12 x 399, are more than 1%, so that p99 sees them
    "las_streams": 12, "las_stream_input_len": (8, 32), "las_stream_output_len": 400, "las_long": 5,
    "las_long_len": 800, "las_long_output_len": 8, "las_start": 0.5, "las_interval": 0.9,
}


# ---- the workload
def book_words(root: Path = ROOT) -> list[str]:
    """The words of the book's chapters, in order, without the HTML comments (snippet and figure markers)."""
    text = "\n".join(p.read_text() for p in sorted((root / "chapters").glob("*.md")))
    return re.sub(r"<!--.*?-->", " ", text, flags=re.S).split()


def make_workload(args: argparse.Namespace, vocab_size: int | None = None) -> list[dict]:
    """--dataset's requests, each a prompt, its length (words, or tokens for a model without a tokenizer),
    an output length and an arrival time (s); the shared-prefix dataset's also name their group."""
    if args.dataset == GSP:
        return shared_prefix_workload(args, vocab_size)
    if args.dataset == LAS:
        return long_among_short_workload(args, vocab_size)
    rng = random.Random(args.seed)
    (in_lo, in_hi), (out_lo, out_hi) = args.input_len, args.output_len
    words = prompt_source(vocab_size, in_hi, "--input-len")
    work, arrival = [], 0.0
    for i in range(args.num_requests):
        n = rng.randint(in_lo, in_hi)
        prompt = draw_prompt(rng, n, words, vocab_size)
        if i and not args.compare_ttft and math.isfinite(args.request_rate):
            arrival += rng.expovariate(args.request_rate)
        work.append({"prompt": prompt, "input_len": n, "output_len": rng.randint(out_lo, out_hi),
                     "arrival_s": round(arrival, 6)})
    return work


def prompt_source(vocab_size: int | None, longest: int, option: str) -> list[str]:
    """The book's words for a model with a tokenizer (vocab_size None), checked to hold a passage of the
    longest length; for one without, no words, once its vocabulary is checked to hold ids to draw."""
    if vocab_size is not None:
        if vocab_size <= 10:
            raise SystemExit(f"the model's vocab_size is {vocab_size}: no token ids in [10, vocab_size) to draw")
        return []
    words = book_words()
    if len(words) <= longest:
        raise SystemExit(f"the chapters hold {len(words)} words: fewer than {option}'s {longest}")
    return words


def draw_prompt(rng: random.Random, n: int, words: list[str], vocab_size: int | None) -> str | list[int]:
    """n words of the book from a random word on; without a tokenizer, n token ids in [10, vocab_size)."""
    if vocab_size is None:
        start = rng.randrange(len(words) - n)
        return " ".join(words[start:start + n])
    return [rng.randrange(10, vocab_size) for _ in range(n)]


def ranged(rng: random.Random, full: int, ratio: float) -> int:
    """A length in [max(int(full * ratio), 1), full], as SGLang's compute_random_lens draws it."""
    return rng.randint(max(int(full * ratio), 1), full)


def join(system: str | list[int], question: str | list[int]) -> str | list[int]:
    """A group's system prompt and a question, as SGLang's generated-shared-prefix joins them (a blank line
    between); token ids follow one another."""
    return f"{system}\n\n{question}" if isinstance(system, str) else system + question


def shared_prefix_workload(args: argparse.Namespace, vocab_size: int | None = None) -> list[dict]:
    """SGLang's generated-shared-prefix: --gsp-num-groups system prompts, each made once, and for each
    --gsp-prompts-per-group requests, the system prompt then a question of its own; shuffled, so that the
    groups interleave, unless --gsp-ordered; then the arrival times."""
    rng, ratio = random.Random(args.seed), args.gsp_range_ratio
    words = prompt_source(vocab_size, max(args.gsp_system_prompt_len, args.gsp_question_len), "--gsp-*-len")
    lens = [ranged(rng, args.gsp_system_prompt_len, ratio) for _ in range(args.gsp_num_groups)]
    systems = [(n, draw_prompt(rng, n, words, vocab_size)) for n in lens]        # each made once, as text
    work = []
    for group, (system_len, system) in enumerate(systems):
        for _ in range(args.gsp_prompts_per_group):
            n = ranged(rng, args.gsp_question_len, ratio)
            question = draw_prompt(rng, n, words, vocab_size)
            work.append({"prompt": join(system, question), "group": group, "system_len": system_len,
                         "question_len": n, "input_len": system_len + n,
                         "output_len": ranged(rng, args.gsp_output_len, ratio)})
    if not args.gsp_ordered:
        rng.shuffle(work)
    arrival = 0.0
    for i, req in enumerate(work):
        if i and not args.compare_ttft and math.isfinite(args.request_rate):
            arrival += rng.expovariate(args.request_rate)
        req["arrival_s"] = round(arrival, 6)
    return work


def long_among_short_workload(args: argparse.Namespace, vocab_size: int | None = None) -> list[dict]:
    """--las-streams short prompts asking for --las-stream-output-len tokens each, all sent at 0 s, then
    --las-long prompts of --las-long-len tokens asking for --las-long-output-len each, the first at
    --las-start s and the others --las-interval s apart, while the streams run."""
    rng = random.Random(args.seed)
    lo, hi = args.las_stream_input_len
    words = prompt_source(vocab_size, max(hi, args.las_long_len), "--las-*-len")
    work = []
    for _ in range(args.las_streams):
        n = rng.randint(lo, hi)
        work.append({"prompt": draw_prompt(rng, n, words, vocab_size), "role": "stream", "input_len": n,
                     "output_len": args.las_stream_output_len, "arrival_s": 0.0})
    tokenizer = prompt_tokenizer(args.model, vocab_size)
    for i in range(args.las_long):
        prompt, n = long_prompt(rng, args.las_long_len, words, vocab_size, tokenizer)
        work.append({"prompt": prompt, "role": "long", "input_len": n, "output_len": args.las_long_output_len,
                     "arrival_s": round(args.las_start + i * args.las_interval, 6)})
    return work


def prompt_tokenizer(model: str, vocab_size: int | None):
    """The tokenizer that counts a text prompt's tokens as the server does: the local checkpoint's
    tokenizer.json (None for token-id prompts, which count themselves)."""
    if vocab_size is not None:
        return None
    path = checkpoint_dir(model)
    if path is None:
        raise SystemExit(f"{LAS}'s long prompts are --las-long-len tokens: {model} is not a local checkpoint "
                         "whose tokenizer.json could count them")
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def long_prompt(rng: random.Random, n: int, words: list[str], vocab_size: int | None,
                tokenizer) -> tuple[str | list[int], int]:
    """A prompt of at most n tokens and its length in tokens: n token ids; or the longest passage of the
    book from a random word (whole words) whose tokens number at most n, and at least n - LONG_SLACK: a
    passage that stops shorter, before a "word" of hundreds of tokens (a table's border of box-drawing
    characters), is drawn again from another word. Every word is a token or more (a byte-level BPE splits
    at whitespace before it merges, so the tokens of k words grow with k): n words hold the passage, and
    bisection finds its end."""
    if tokenizer is None:
        return draw_prompt(rng, n, words, vocab_size), n
    for _ in range(100):
        start = rng.randrange(len(words) - n)
        count = lambda k: len(tokenizer.encode(" ".join(words[start:start + k])).ids)  # noqa: E731
        lo, hi = 0, n                               # count(lo) <= n; the longest such k is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if count(mid) <= n else (lo, mid - 1)
        if count(lo) >= n - LONG_SLACK:
            return " ".join(words[start:start + lo]), count(lo)
    raise SystemExit(f"no passage of the chapters found of {n - LONG_SLACK}..{n} tokens in 100 draws")


def warmup_request(args: argparse.Namespace, work: list[dict], vocab_size: int | None = None) -> dict:
    """The request --warmup sends: the first of the workload; for the shared-prefix dataset one of the same
    lengths whose system prompt is no group's (drawn from a generator of its own), so that every group's
    prefix is cold when the timed requests begin; for long-among-short a long prompt of the same length
    that the workload does not hold (its first big prefill is untimed too)."""
    if args.dataset == LAS:
        rng, words = random.Random(f"warmup {args.seed}"), prompt_source(vocab_size, args.las_long_len, "--las-*-len")
        prompt, n = long_prompt(rng, args.las_long_len, words, vocab_size, prompt_tokenizer(args.model, vocab_size))
        return {"prompt": prompt, "role": "long", "input_len": n, "output_len": args.las_long_output_len,
                "arrival_s": 0.0}
    if args.dataset != GSP:
        return work[0]
    first, rng = work[0], random.Random(f"warmup {args.seed}")
    words = prompt_source(vocab_size, max(first["system_len"], first["question_len"]), "--gsp-*-len")
    prompt = join(draw_prompt(rng, first["system_len"], words, vocab_size),
                  draw_prompt(rng, first["question_len"], words, vocab_size))
    return {"prompt": prompt, "group": None, "system_len": first["system_len"], "question_len": first["question_len"],
            "input_len": first["input_len"], "output_len": first["output_len"], "arrival_s": 0.0}


def checkpoint_dir(model: str) -> Path | None:
    """The local checkpoint directory of a model's name ("tiny") or path, if there is one."""
    shipped = SHIPPED / model
    path = shipped if "/" not in model and (shipped / "config.json").is_file() else Path(model).expanduser()
    return path if (path / "config.json").is_file() else None


def token_id_vocab(model: str) -> int | None:
    """The vocab_size of a local checkpoint without tokenizer.json (its prompts must be token ids); None
    for one with a tokenizer, or a model that is not a local directory (text prompts)."""
    path = checkpoint_dir(model)
    if path is None or (path / "tokenizer.json").is_file():
        return None
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def shape_checkpoint(shape: str, cache_dir: Path) -> Path:
    """tools/bench.py's random-weight checkpoint of `shape` under cache_dir: made by its make_checkpoint
    (on a CUDA GPU, or on the CPU where there is none), or found there from an earlier run."""
    spec = importlib.util.spec_from_file_location("bench", ROOT / "tools" / "bench.py")
    bench_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_py)
    return bench_py.make_checkpoint(shape, cache_dir)


# ---- a server of our own
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(config: dict, port: int, model: str, device: str, max_running: int | None = None,
                   max_seq_len: int | None = None) -> list[str]:
    """`minioverlap serve` for a configuration: its loop, MTP drafts, --first-tokens-first, the prefix cache
    only if the configuration asks for it (+cache): --no-prefix-cache otherwise; chunked prefill only if it
    asks for it (+chunkN, then maybe +mixed): --chunked-prefill-size -1 otherwise."""
    return [sys.executable, "-m", "minioverlap", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model", model, "--device", device, "--loop", config["loop"],
            *(["--mtp", str(config["mtp"])] if config["mtp"] else []),
            *(["--first-tokens-first"] if config["ftf"] else []),
            "--prefix-cache" if config["cache"] else "--no-prefix-cache",
            "--chunked-prefill-size", str(config["chunk"] or -1),
            *(["--enable-mixed-chunk"] if config["mixed"] else []),
            *(["--max-running", str(max_running)] if max_running else []),
            *(["--max-seq-len", str(max_seq_len)] if max_seq_len else [])]


class ServerProcess:
    """`minioverlap serve --loop L [--mtp K] [--first-tokens-first] --[no-]prefix-cache --chunked-prefill-size
    N|-1 [--enable-mixed-chunk]` on a free port of 127.0.0.1, its output in a temporary file (a pipe nobody
    reads could fill and block it), in a session of its own so that a hung one can be killed with everything
    it started."""

    def __init__(self, config: dict, model: str, device: str, max_running: int | None = None,
                 max_seq_len: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = server_command(config, self.port, model, device, max_running, max_seq_len)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                        start_new_session=True)

    def output(self, tail: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-tail:]

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited with {self.process.returncode} before it was healthy:\n"
                                 f"$ {' '.join(self.cmd)}\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise SystemExit(f"the server did not answer /health within {timeout_s:.0f} s:\n{self.output()}")

    def stop(self, timeout_s: float = 30.0) -> dict:
        """SIGTERM, as a supervisor stops it. Its exit code (None: it did not exit within timeout_s and was
        killed) and the processes of its session still there 10 s after it exited (the scheduler process
        it started, say), which are then killed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return {"exit_code": None, "left_behind": [], "output": self.output()}
        deadline = time.monotonic() + 10.0
        while (left := session_processes(self.process.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            self.kill()
        return {"exit_code": code, "left_behind": left, "output": self.output()}

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def session_processes(sid: int) -> list[str]:
    """The command lines of the live processes in session `sid` (Linux's /proc; elsewhere none are seen)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()        # after the command's name, which may hold spaces
            if int(fields[3]) == sid and fields[0] != "Z":             # field 6, the session id; not a zombie
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
        except (OSError, IndexError, ValueError):
            pass
    return found


# ---- the client
async def one_request(client: httpx.AsyncClient, url: str, model: str, req: dict, t0: float) -> dict:
    """One streamed completion, timed on the client's clock (perf_counter; start_s from t0)."""
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["output_len"], "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    out = {"start_s": None, "ttft_s": None, "itl_s": [], "latency_s": None, "prompt_tokens": None,
           "cached_tokens": None, "output_tokens": None, "chunks": 0, "empty_chunks": 0, "finish_reason": None,
           "error": None}
    sent = time.perf_counter()
    out["start_s"] = sent - t0
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                out["error"] = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                now, chunk = time.perf_counter(), json.loads(data)
                if "error" in chunk:
                    out["error"] = chunk["error"].get("message", str(chunk["error"]))
                    break
                if usage := chunk.get("usage"):
                    out["prompt_tokens"] = usage["prompt_tokens"]
                    out["output_tokens"] = usage["completion_tokens"]
                    out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                choices = chunk.get("choices") or []
                if choices:                 # a step's tokens, its text maybe empty (held back, or no tokenizer)
                    if last is None:
                        out["ttft_s"] = now - sent
                    else:
                        out["itl_s"].append(now - last)
                    last = now
                    out["chunks"] += 1
                    out["empty_chunks"] += not any(choice.get("text") for choice in choices)
                for choice in choices:
                    out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    except httpx.HTTPError as err:
        out["error"] = f"{type(err).__name__}: {err}"
        return out
    out["latency_s"] = time.perf_counter() - sent
    if out["error"] is None and (out["ttft_s"] is None or out["output_tokens"] is None):
        out["error"] = "the stream ended without a chunk of tokens or without its usage chunk"
    return out


async def run_workload(targets: dict[str, tuple[str, str]], work: list[dict], turns: bool, warmup: int,
                       advance, warmup_req: dict | None = None) -> dict[str, tuple[list[dict], float]]:
    """The workload on every target (name -> (url, model)), after `warmup` untimed requests to each (warmup_req,
    by default the workload's first); per target its results and its duration (s). Without `turns`, one
    target: the requests at their arrival times. With `turns`, one request at a time, taking turns: request
    i goes to every target in a rotated order, each when the one before has finished, so that a slow spell
    of the machine falls on all of them; a target's duration is then the sum of its latencies (the time it
    was serving)."""
    limits = httpx.Limits(max_connections=len(work) + 8, max_keepalive_connections=len(work) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        for url, model in targets.values():
            for _ in range(warmup):
                await one_request(client, url, model, warmup_req or work[0], time.perf_counter())
        t0 = time.perf_counter()
        if turns:
            names, results = list(targets), {name: [] for name in targets}
            for i, req in enumerate(work):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    results[name].append(await one_request(client, *targets[name], req, t0))
                    advance(name)
            return {name: (rs, sum(r["latency_s"] or 0.0 for r in rs)) for name, rs in results.items()}
        (name, (url, model)), = targets.items()

        async def at_arrival(req: dict) -> dict:
            await asyncio.sleep(max(0.0, t0 + req["arrival_s"] - time.perf_counter()))
            result = await one_request(client, url, model, req, t0)
            advance(name)
            return result
        results = list(await asyncio.gather(*(at_arrival(req) for req in work)))
    ends = [r["start_s"] + r["latency_s"] for r in results if r["latency_s"] is not None]
    return {name: (results, max(ends) if ends else time.perf_counter() - t0)}


def served_model(url: str) -> tuple[str, int | None]:
    """The model a server serves (GET /v1/models) and its context."""
    data = httpx.get(f"{url}/v1/models", timeout=10.0).json()["data"][0]
    return data["id"], data.get("max_model_len")


def integrity(url: str, timeout_s: float = 30.0) -> dict | None:
    """The server's integrity report once it is idle (None if it has no /integrity or stays busy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = httpx.get(f"{url}/integrity", timeout=30.0)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        report = response.json()
        if report.get("idle") or time.monotonic() > deadline:
            return report
        time.sleep(0.1)


# ---- the figures
def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear between the closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(name: str, values: list[float]) -> dict:
    """{name}_ms_mean, _median and _p99 of values in seconds."""
    ms = [v * 1e3 for v in values]
    return {f"{name}_ms_mean": sum(ms) / len(ms) if ms else None, f"{name}_ms_median": percentile(ms, 50),
            f"{name}_ms_p99": percentile(ms, 99)}


def hit_rate(done: list[dict]) -> tuple[int | None, float | None]:
    """The prompt tokens the server found in its prefix cache, summed over the completed requests, and their
    share of all their prompt tokens; None where a request's usage did not say (a server without the field)."""
    cached = [r.get("cached_tokens") for r in done]
    if not done or None in cached:
        return None, None
    prompt = sum(r["prompt_tokens"] for r in done)
    return sum(cached), (sum(cached) / prompt if prompt else None)


def aggregate(name: str, results: list[dict], work: list[dict], duration_s: float) -> dict:
    """A configuration's figures, flat: its name, then numbers (None where no request completed)."""
    done = [r for r in results if r["error"] is None]
    cached, rate = hit_rate(done)
    out_tokens = sum(r["output_tokens"] for r in done)
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in done if r["output_tokens"] > 1]
    chunks = sum(r["chunks"] for r in done)
    return {
        "config": name, "requests": len(results), "completed": len(done), "duration_s": duration_s,
        "req_s": len(done) / duration_s, "out_tok_s": out_tokens / duration_s,
        **spread("ttft", [r["ttft_s"] for r in done]), **spread("tpot", tpot),
        **spread("itl", [g for r in done for g in r["itl_s"]]), **spread("e2e", [r["latency_s"] for r in done]),
        "tok_per_chunk": out_tokens / chunks if chunks else None,
        "input_tokens": sum(r["prompt_tokens"] for r in done), "cached_tokens": cached, "hit_rate": rate,
        "output_tokens": out_tokens,
        "requested_tokens": sum(w["output_len"] for w, r in zip(work, results) if r["error"] is None),
        "concurrency": sum(r["latency_s"] for r in done) / duration_s,   # requests in flight, on average
        **({} if not any("role" in w for w in work) else roles(work, results)),
    }


def roles(work: list[dict], results: list[dict]) -> dict:
    """long-among-short's own figures: the ITL of the short streams (the gaps a long prompt's prefill opens
    in them), its worst gap, the TTFT of the long prompts, and their ITL: the decode steps that hold a long
    prompt's context beside the streams."""
    def completed(role: str) -> list[dict]:
        return [r for w, r in zip(work, results) if w.get("role") == role and r["error"] is None]
    gaps = [g for r in completed("stream") for g in r["itl_s"]]
    return {**spread("stream_itl", gaps), "stream_itl_ms_max": max(gaps) * 1e3 if gaps else None,
            **spread("long_ttft", [r["ttft_s"] for r in completed("long")]),
            **spread("long_itl", [g for r in completed("long") for g in r["itl_s"]])}


# ---- the configurations
def bench_configs(args: argparse.Namespace, configs: list[dict], work: list[dict], progress,
                  warmup_req: dict | None = None) -> list[tuple[dict, dict]]:
    """Start the servers of `configs` together (or take --url's), run the workload on them (after --warmup
    warmup_req), check each is clean (/integrity) and stop it; per configuration its figures and its run
    (server and raw numbers)."""
    tasks = {c["name"]: progress.add_task(f"{c['name']}: starting", total=len(work)) for c in configs}
    servers: dict[str, ServerProcess] = {}
    stops: dict[str, dict] = {}
    try:
        if not args.url:
            for c in configs:
                servers[c["name"]] = ServerProcess(c, args.model, args.device, args.max_running, args.max_seq_len)
            for server in servers.values():
                server.wait_healthy(args.startup_timeout)
        urls = {c["name"]: servers[c["name"]].url if servers else args.url.rstrip("/") for c in configs}
        models = {name: served_model(url) for name, url in urls.items()}
        for task in tasks.values():
            progress.update(task, description=progress.tasks[task].description.replace("starting", "running"))
        load_before = os.getloadavg()[0]
        runs = asyncio.run(run_workload({name: (urls[name], models[name][0]) for name in urls}, work,
                                        args.compare_ttft, args.warmup, lambda name: progress.advance(tasks[name]),
                                        warmup_req))
        load_after = os.getloadavg()[0]
        reports = {name: integrity(url) for name, url in urls.items()}
    finally:
        for name, server in servers.items():
            stops[name] = server.stop()
    records = []
    for c in configs:
        name = c["name"]
        progress.update(tasks[name], description=f"{name}: done")
        results, duration = runs[name]
        stop = stops.get(name, {"exit_code": None, "left_behind": [], "output": ""})
        record = {"config": name, "loop": c["loop"], "mtp": c["mtp"], "ftf": c["ftf"], "cache": c["cache"],
                  "chunk": c["chunk"], "mixed": c["mixed"], "url": urls[name],
                  "served_model": models[name][0], "max_model_len": models[name][1],
                  "command": servers[name].cmd if servers else None, "exit_code": stop["exit_code"],
                  "left_behind": stop["left_behind"], "integrity": reports[name],
                  "loadavg": [load_before, load_after],          # the host's 1-minute load, before and after
                  "per_request": results}
        report = reports[name]
        if servers and stop["exit_code"] is None:
            record["problem"] = f"the server did not exit within 30 s of SIGTERM (killed):\n{stop['output']}"
        elif stop["exit_code"] not in (None, 0):
            record["problem"] = f"the server exited with {stop['exit_code']} after SIGTERM:\n{stop['output']}"
        elif stop["left_behind"]:
            record["problem"] = f"processes of the server still ran 10 s after it exited (killed): {stop['left_behind']}"
        elif report is not None and (not report.get("idle") or report.get("problems")):
            record["problem"] = f"the server is not clean after the run: {report}"
        records.append((aggregate(name, results, work, duration), record))
    return records


def mode(args: argparse.Namespace) -> str:
    if args.dataset == LAS:
        return f"streams at 0 s, long prompts from {args.las_start:g} s every {args.las_interval:g} s"
    if args.compare_ttft:
        return "one at a time"
    return f"rate {args.request_rate:g}" if math.isfinite(args.request_rate) else "all at once"


def bench(args: argparse.Namespace) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    if args.shape:
        args.model = str(shape_checkpoint(args.shape, Path(args.cache_dir).expanduser()))
    model = served_model(args.url.rstrip("/"))[0] if args.url else args.model
    args.model = model                                  # the model whose tokenizer counts long prompts' tokens
    vocab = token_id_vocab(model)
    work = make_workload(args, vocab)
    warmup_req = warmup_request(args, work, vocab)
    configs = ([{"name": args.url, "loop": None, "mtp": None, "ftf": None, "cache": None, "chunk": None,
                 "mixed": None}] if args.url else args.configs)
    shared = args.dataset == GSP
    gsp = {"num_groups": args.gsp_num_groups, "prompts_per_group": args.gsp_prompts_per_group,
           "system_prompt_len": args.gsp_system_prompt_len, "question_len": args.gsp_question_len,
           "output_len": args.gsp_output_len, "range_ratio": args.gsp_range_ratio,
           "ordered": args.gsp_ordered} if shared else None
    las = {"streams": args.las_streams, "stream_input_len": list(args.las_stream_input_len),
           "stream_output_len": args.las_stream_output_len, "long": args.las_long, "long_len": args.las_long_len,
           "long_output_len": args.las_long_output_len, "start_s": args.las_start,
           "interval_s": args.las_interval} if args.dataset == LAS else None
    shared = shared or args.dataset == LAS          # neither has the random dataset's lengths
    record = {"tool": "tools/bench_serving.py", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "argv": sys.argv[1:], "device": None if args.url else args.device,
              "model": f"qwen3-{args.shape}-random" if args.shape else model, "mode": mode(args),
              "results": [],
              "workload": {"dataset": args.dataset, "num_requests": len(work), "shape": args.shape,
                           "model_path": model,
                           "request_rate": args.request_rate if math.isfinite(args.request_rate)
                           and not args.compare_ttft else None,
                           "prompts": "words of the chapters" if vocab is None else f"token ids in [10, {vocab})",
                           "input_len": None if shared else list(args.input_len),
                           "input_unit": "words" if vocab is None else "tokens",
                           "output_len": None if shared else list(args.output_len), "gsp": gsp, "las": las,
                           "seed": args.seed, "warmup": args.warmup,
                           "warmup_request": warmup_req if shared else None,   # else the first request
                           "max_running": args.max_running, "requests": work},
              "host_cpus": os.cpu_count(), "runs": []}
    columns = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        for group in [configs] if args.compare_ttft else [[c] for c in configs]:
            for result, run in bench_configs(args, group, work, progress, warmup_req):
                record["results"].append(result)
                record["runs"].append(run)
            if args.json:                                   # after each configuration: a crash keeps the rest
                write(record, args.json)
    return record


def write(record: dict, path: str) -> None:
    """The record on one line, every time to the microsecond (seconds to 6 decimals, ms to 3): a run of
    hundreds of requests stays a few hundred kB."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(rounded(record), separators=(",", ":")) + "\n")


def rounded(value: object) -> object:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


# ---- the table
def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def caption(w: dict) -> str:
    """The workload in a line: its prompts and output lengths."""
    if w.get("dataset", RANDOM) == GSP:
        g, unit = w["gsp"], w["input_unit"]
        lens = {k: str(g[k]) if g["range_ratio"] == 1 else f"{max(int(g[k] * g['range_ratio']), 1)}..{g[k]}"
                for k in ("system_prompt_len", "question_len", "output_len")}
        prompts = (f"{g['num_groups']} groups x {g['prompts_per_group']} prompts "
                   f"({'in order' if g['ordered'] else 'shuffled'}): a system prompt of {lens['system_prompt_len']} "
                   f"{unit} per group + a question of {lens['question_len']}, {w['prompts']}; "
                   f"{lens['output_len']} output tokens")
    elif w.get("dataset") == LAS:
        las = w["las"]
        longs = [r["input_len"] for r in w["requests"] if r["role"] == "long"]
        span = f"{min(longs)}..{max(longs)}" if longs else "-"
        prompts = (f"{las['streams']} streams of {las['stream_input_len'][0]}..{las['stream_input_len'][1]} "
                   f"{w['input_unit']}, {las['stream_output_len']} output tokens each, at 0 s; {las['long']} long "
                   f"prompts of {span} tokens (at most {las['long_len']}), {las['long_output_len']} output tokens "
                   f"each, from {las['start_s']:g} s every {las['interval_s']:g} s; {w['prompts']}")
    else:
        prompts = (f"prompts {w['input_len'][0]}..{w['input_len'][1]} {w['prompts']}, "
                   f"{w['output_len'][0]}..{w['output_len'][1]} output tokens")
    streams = "; stream ITL: the streams' alone, long TTFT: the long prompts'" if w.get("dataset") == LAS else ""
    return (f"{prompts} (ignore_eos), greedy, seed {w['seed']}; ms; ITL per chunk (a step), TPOT per token; "
            f"hit: cached / prompt tokens{streams}")


def against(r: dict, run: dict, base: dict, base_run: dict, one_at_a_time: bool) -> str:
    """r's median TTFT and output tokens/s against base's (one at a time, also request by request)."""
    ttft = (r["ttft_ms_median"] / base["ttft_ms_median"] if r["ttft_ms_median"] and base["ttft_ms_median"]
            else None)
    tok = r["out_tok_s"] / base["out_tok_s"] if base["out_tok_s"] else None
    paired = ""
    if one_at_a_time:                           # request i ran on both back to back: compare it alone
        ratios = [a["ttft_s"] / b["ttft_s"] for a, b in zip(run["per_request"], base_run["per_request"])
                  if a["ttft_s"] and b["ttft_s"]]
        paired = f" (request by request: median ratio {fmt(percentile(ratios, 50), '.2f', 'x')})"
    return (f"{r['config']} against {base['config']}: median TTFT {fmt(ttft, '.2f', 'x')}{paired}, "
            f"output tok/s {fmt(tok, '.2f', 'x')}")


def report(record: dict) -> None:
    """One row per configuration; then each one's median TTFT and output tokens/s against the first's, and
    each +cache configuration's against the same configuration without the cache, if it ran."""
    from rich.console import Console
    from rich.table import Table
    console = Console(width=None if sys.stdout.isatty() else 160)
    w, how = record["workload"], record["mode"]
    how = f"Poisson, {how.split()[1]} req/s" if how.startswith("rate ") else how
    where = f" ({record['model']} on {record['device']})" if record["device"] else f" ({record['model']})"
    table = Table(title=f"minioverlap serve: {w['num_requests']} requests, {how}{where}", caption=caption(w))
    columns = {"config": None, "done": None, "s": "duration_s", "req/s": "req_s", "out tok/s": "out_tok_s",
               "TTFT mean": "ttft_ms_mean", "TTFT med": "ttft_ms_median", "TTFT p99": "ttft_ms_p99",
               "TPOT med": "tpot_ms_median", "TPOT p99": "tpot_ms_p99", "ITL med": "itl_ms_median",
               "ITL p99": "itl_ms_p99", "E2E med": "e2e_ms_median", "tok/chunk": "tok_per_chunk", "hit": "hit_rate"}
    if w.get("dataset") == LAS:                     # the streams' gaps and the long prompts' waits, for TPOT's
        columns = {**{k: v for k, v in columns.items() if not k.startswith(("TPOT", "E2E"))},
                   "stream ITL med": "stream_itl_ms_median", "stream ITL p99": "stream_itl_ms_p99",
                   "stream ITL max": "stream_itl_ms_max", "long TTFT med": "long_ttft_ms_median"}
        columns["hit"] = columns.pop("hit")
    specs = {"duration_s": ".2f", "req_s": ".2f", "tok_per_chunk": ".2f"}
    for name in columns:
        table.add_column(name, justify="left" if name == "config" else "right")
    for r in record["results"]:
        done = f"{r['completed']}/{r['requests']}"
        hit = r.get("hit_rate")                     # None: not reported (or a record made before chapter 17)
        table.add_row(r["config"], done if r["completed"] == r["requests"] else f"[red]{done}[/red]",
                      *(fmt(r[key], specs.get(key, ".1f")) for key in list(columns.values())[2:-1]),
                      fmt(None if hit is None else 100 * hit, ".1f", "%"))
    console.print(table)
    one_at_a_time = record["mode"] == "one at a time"
    runs = dict(zip((r["config"] for r in record["results"]), zip(record["results"], record["runs"])))
    first, first_run = record["results"][0], record["runs"][0]
    for r, run in zip(record["results"][1:], record["runs"][1:]):
        console.print(against(r, run, first, first_run, one_at_a_time), highlight=False)
    for r, run in zip(record["results"], record["runs"]):
        twin = r["config"].removesuffix("+cache")
        if r["config"].endswith("+cache") and twin in runs and twin != first["config"]:
            console.print(against(r, run, *runs[twin], one_at_a_time), highlight=False)
    console.print(f"the host's load (1-minute average, {record['host_cpus']} CPUs) before and after: "
                  + ", ".join(f"{run['config']} {run['loadavg'][0]:.1f}/{run['loadavg'][1]:.1f}"
                              for run in record["runs"]), style="dim", highlight=False)
    for run in record["runs"]:
        name, per_request, work = run["config"], run["per_request"], w["requests"]
        failed = [r["error"] for r in per_request if r["error"]]
        if failed:
            console.print(f"[red]{name}: {len(failed)} failed[/red], the first: {failed[0]}", highlight=False)
        short = sum(1 for asked, r in zip(work, per_request)
                    if r["error"] is None and r["output_tokens"] != asked["output_len"])
        if short:
            console.print(f"[red]{name}: {short} requests got another number of tokens than they asked for[/red]")
        if run.get("problem"):
            console.print(f"[red]{name}: {run['problem']}[/red]", highlight=False)
        if late := late_long_prompts(work, per_request):
            console.print(f"[red]{name}: {late} long prompts came after the last stream had ended: they opened no "
                          "gap in one (more --las-stream-output-len, or less --las-start or --las-interval)[/red]",
                          highlight=False)


def late_long_prompts(work: list[dict], results: list[dict]) -> int:
    """long-among-short's long prompts sent after the last stream ended (0 for the other datasets)."""
    ends = [r["start_s"] + r["latency_s"] for w, r in zip(work, results)
            if w.get("role") == "stream" and r["latency_s"] is not None]
    return sum(1 for w, r in zip(work, results) if w.get("role") == "long" and ends and r["start_s"] > max(ends))


# ---- the command line
def token_range(text: str) -> tuple[int, int]:
    """'8..64' -> (8, 64); '16' -> (16, 16)."""
    lo, sep, hi = text.partition("..")
    try:
        pair = (int(lo), int(hi if sep else lo))
    except ValueError:
        pair = (0, 0)
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"must be N or A..B with 1 <= A <= B, got {text!r}")
    return pair


def rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of requests/s > 0, or inf, got {text!r}")
    return value


def configs(text: str) -> list[dict]:
    """'normal,overlap+mtp2+ftf+cache,overlap+chunk64+mixed' -> one dict per server: its name, loop, MTP drafts,
    --first-tokens-first, the prefix cache (without +cache, --no-prefix-cache), the chunked prefill size (None
    without +chunkN: --chunked-prefill-size -1) and mixed steps."""
    out = []
    for name in (n.strip() for n in text.split(",")):
        if (m := CONFIG.match(name)) is None:
            raise argparse.ArgumentTypeError(f"{name!r} is not LOOP[+mtpK][+ftf][+cache][+chunkN[+mixed]] "
                                             "(LOOP: normal or overlap)")
        if m["ftf"] and m["loop"] != "overlap":
            raise argparse.ArgumentTypeError(f"{name!r}: +ftf (--first-tokens-first) is the overlap loop's; the "
                                             "normal loop handles every step before it launches the next")
        if m["mixed"] and not m["chunk"]:
            raise argparse.ArgumentTypeError(f"{name!r}: +mixed (--enable-mixed-chunk) mixes the chunks of +chunkN "
                                             "into decode steps: give +chunkN before it")
        if m["mixed"] and m["mtp"]:
            raise argparse.ArgumentTypeError(f"{name!r}: the server refuses mixed steps with MTP drafts")
        out.append({"name": name, "loop": m["loop"], "mtp": int(m["mtp"] or 0), "ftf": bool(m["ftf"]),
                    "cache": bool(m["cache"]), "chunk": int(m["chunk"]) if m["chunk"] else None,
                    "mixed": bool(m["mixed"])})
    if len({c["name"] for c in out}) < len(out):
        raise argparse.ArgumentTypeError(f"{text!r} names a configuration twice")
    return out


def ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def bounded(cast, low: float, what: str):
    """An argparse type: `cast` of the text, at least `low` and finite, else an error that says `what`."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not low <= value < math.inf:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


positive = bounded(int, 1, "an integer >= 1")
natural = bounded(int, 0, "an integer >= 0")
seconds = bounded(float, 0, "a number of seconds >= 0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=configs, metavar="LIST",
                        help="servers to compare, comma-separated: normal, overlap, normal+mtp2, overlap+ftf, "
                             "overlap+mtp2+ftf, overlap+cache, overlap+chunk64, overlap+chunk64+mixed, ...; the "
                             "prefix cache only with +cache, chunked prefill only with +chunkN, in that order "
                             "(default: normal,overlap)")
    parser.add_argument("--url", help="measure the server running there instead (no --configs)")
    parser.add_argument("--model", help="the model each started server serves: tiny (the default) or a checkpoint "
                                        "directory; without tokenizer.json the prompts are token ids")
    parser.add_argument("--shape", choices=("0.6b", "8b"),
                        help="serve tools/bench.py's random-weight checkpoint of Qwen3-0.6B's or Qwen3-8B's shape "
                             "(made once under --cache-dir); the prompts are token ids")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE, metavar="DIR",
                        help="where --shape's checkpoints are made and kept (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="where each started server runs it (default: %(default)s)")
    parser.add_argument("--max-running", type=positive, metavar="N",
                        help="each started server's request slots (serve --max-running; default: the engine's)")
    parser.add_argument("--max-seq-len", type=positive, metavar="N",
                        help="each started server's context (serve --max-seq-len; default: the model's): a real "
                             "shape's full context for every slot is a large KV pool")
    parser.add_argument("--dataset", "--dataset-name", choices=(RANDOM, GSP, LAS), default=RANDOM,
                        help="the workload, by SGLang's names (--dataset-name is SGLang's spelling): random, "
                             "--num-requests prompts of --input-len; or generated-shared-prefix, groups of "
                             "prompts that share a system prompt, --gsp-*; or long-among-short (ours), long "
                             "prompts arriving among short streaming requests, --las-* (default: %(default)s)")
    parser.add_argument("--request-rate", type=rate, default=math.inf, metavar="R",
                        help="Poisson arrivals at R requests/s, or inf: all at once (default)")
    rnd = parser.add_argument_group("the random dataset")
    rnd.add_argument("--num-requests", type=positive, help=f"requests (default: {DEFAULTS['num_requests']})")
    rnd.add_argument("--input-len", type=token_range, metavar="A..B",
                     help="prompt length in words of the chapters' prose, or in tokens for a model "
                          "without a tokenizer (default: 8..64)")
    rnd.add_argument("--output-len", type=token_range, metavar="A..B",
                     help="output tokens per request (default: 16..64)")
    gsp = parser.add_argument_group("the generated-shared-prefix dataset", "SGLang's options; the lengths of "
                                    "prompts in words of the chapters' prose, or in tokens for a model without a "
                                    "tokenizer")
    gsp.add_argument("--gsp-num-groups", type=positive, metavar="N",
                     help=f"system prompts, one per group (default: {DEFAULTS['gsp_num_groups']})")
    gsp.add_argument("--gsp-prompts-per-group", type=positive, metavar="N",
                     help=f"requests per group, each with its own question "
                          f"(default: {DEFAULTS['gsp_prompts_per_group']})")
    gsp.add_argument("--gsp-system-prompt-len", type=positive, metavar="N",
                     help=f"a system prompt's length (default: {DEFAULTS['gsp_system_prompt_len']})")
    gsp.add_argument("--gsp-question-len", type=positive, metavar="N",
                     help=f"a question's length (default: {DEFAULTS['gsp_question_len']})")
    gsp.add_argument("--gsp-output-len", type=positive, metavar="N",
                     help=f"output tokens per request (default: {DEFAULTS['gsp_output_len']})")
    gsp.add_argument("--gsp-range-ratio", type=ratio, metavar="R",
                     help="each length drawn from [max(int(N*R), 1), N]; 1: exactly N "
                          f"(default: {DEFAULTS['gsp_range_ratio']:g})")
    gsp.add_argument("--gsp-ordered", action="store_true", default=None,
                     help="send the groups one after another, in order; by default the requests are shuffled "
                          "and the groups interleave")
    las = parser.add_argument_group("the long-among-short dataset", "short prompts streaming long outputs, all sent "
                                    "at once, and long prompts sent one by one while they run")
    las.add_argument("--las-streams", type=natural, metavar="N",
                     help=f"short streaming requests, sent at 0 s (default: {DEFAULTS['las_streams']})")
    las.add_argument("--las-stream-input-len", type=token_range, metavar="A..B",
                     help="a stream's prompt length in words of the chapters' prose, or in tokens for a model "
                          "without a tokenizer (default: 8..32)")
    las.add_argument("--las-stream-output-len", type=positive, metavar="N",
                     help=f"output tokens per stream (default: {DEFAULTS['las_stream_output_len']})")
    las.add_argument("--las-long", type=natural, metavar="N",
                     help=f"long prompts (default: {DEFAULTS['las_long']})")
    las.add_argument("--las-long-len", type=positive, metavar="N",
                     help="a long prompt's length in tokens: the chapters' prose cut at the last whole word "
                          "within N tokens of the model's tokenizer, or N token ids; with its output, within the "
                          f"context (default: {DEFAULTS['las_long_len']})")
    las.add_argument("--las-long-output-len", type=positive, metavar="N",
                     help=f"output tokens per long prompt (default: {DEFAULTS['las_long_output_len']})")
    las.add_argument("--las-start", type=seconds, metavar="S",
                     help=f"when the first long prompt is sent (default: {DEFAULTS['las_start']:g} s)")
    las.add_argument("--las-interval", type=seconds, metavar="S",
                     help=f"seconds between long prompts (default: {DEFAULTS['las_interval']:g})")
    parser.add_argument("--seed", type=int, default=0, help="the workload's random.Random seed (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests before each run (default: %(default)s)")
    parser.add_argument("--compare-ttft", action="store_true",
                        help="send the requests one at a time: each TTFT is a lone request's (ignores --request-rate)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a server has to answer /health")
    parser.add_argument("--json", metavar="FILE", help="write the arguments, workload, figures and every request here")
    parser.add_argument("--report", metavar="FILE", help="no run: print the table of a recorded --json FILE")
    args = parser.parse_args(argv)
    if args.url and args.configs:
        parser.error("--url measures the server there: --configs starts servers of its own; give one of them")
    if args.url and (args.shape or args.model or args.max_running or args.max_seq_len):
        parser.error("--url measures the server there: --model, --shape, --max-running and --max-seq-len are for "
                     "servers it starts")
    if args.shape and args.model:
        parser.error(f"--shape {args.shape} serves a checkpoint of its own: give --shape or --model, not both")
    args.model = args.model or "tiny"
    args.configs = args.configs or configs("normal,overlap")
    owner = lambda name: {"gsp": GSP, "las": LAS}.get(name.split("_")[0], RANDOM)   # noqa: E731
    other = [name for name in DEFAULTS if getattr(args, name) is not None and owner(name) != args.dataset]
    if other:
        options = ", ".join("--" + name.replace("_", "-") for name in other)
        parser.error(f"{options}: {'not options' if len(other) > 1 else 'not an option'} of the {args.dataset} dataset"
                     + (" (it sends --gsp-num-groups x --gsp-prompts-per-group requests)" if args.dataset == GSP else ""))
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.dataset == LAS and (args.compare_ttft or math.isfinite(args.request_rate)):
        parser.error(f"the {LAS} dataset sends its requests at its own times (--las-start, --las-interval): "
                     "not with --request-rate or --compare-ttft")
    if args.dataset == LAS and args.las_streams + args.las_long == 0:
        parser.error(f"the {LAS} dataset needs a request: --las-streams and --las-long are both 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        try:
            record = json.loads(Path(args.report).read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"--report {args.report}: {err}") from None
        if not isinstance(record, dict) or not {"results", "runs", "workload"} <= set(record):
            raise SystemExit(f"--report {args.report}: not a record of this tool (no results, runs and workload)")
    else:
        record = bench(args)
    report(record)
    if args.json and not args.report:
        print(f"wrote {args.json}")
    failed = any(r["completed"] < r["requests"] for r in record["results"])
    if (failed or any(run.get("problem") for run in record["runs"])) and not args.report:
        sys.exit(1)


if __name__ == "__main__":
    main()
