"""The waits overlap cannot remove (chapter 19), measured on this machine: a grammar's masks and the n-gram
drafter's lookup, at batch 1 and 16, in the normal loop and in the overlap loop.

    python tools/bench_waits.py                                   # prints the table
    python tools/bench_waits.py --json chapters/figures/19-cpu-waits.json
    python tools/bench_waits.py --device cuda --kinds free grammar mtp grammar-mtp ngram   # on a GPU
    python tools/bench_waits.py --device cuda --shape 0.6b --cache-dir /tmp/ckpt --kinds free grammar ngram

Every case runs the same prompts (bench_cpu.py's 16 code prompts, or the first of them at batch 1), greedy,
and each request makes exactly --tokens new tokens, so that the cases do the same work:

    free      no grammar, no drafter: the plain step (the baseline)
    grammar   every request follows a regex that cannot end before --tokens tokens ([0-9a-z_,.]{400}; {1000}
              for a random model, whose tokens run long):
              each step fills a row of the mask per request on the host. `mask us` is the host time of
              that fill (xgrammar's fill_next_token_bitmask for every constrained request) per step. In the
              overlap loop it is the put-off sample's wait: the time from the step before handled to this
              step's sample queued is the `process` and `mask` phases, which a GPU hides under the forward
              it launched first as long as they take less than it
    ngram     the n-gram drafter, --drafts drafts a step (ignore_eos, the same tokens as `free`): `lookup
              us` is the host time of a step's lookups; the accept length is tokens per verify pass. The
              overlap loop handles each step before the next is built (its trace: no launch before the
              wait), so its steps equal the normal loop's
    mtp       MTP drafting --drafts tokens a step (the shipped model's MTP layer), no grammar
    grammar-mtp   MTP under the regex: a verify window's masks (`mask us`: window_bitmask per step). In
              the overlap loop the verify's accept and draft extend are put off (`mask`), so that the
              masks are filled while the verify pass runs

Each case is warmed up once and run --repeats times; the table gives the median. On a CPU a step's
forward runs when it is launched (there is no device to queue it on), so no loop can hide anything
there: the numbers are the host's costs, which on a GPU decide whether a wait is hidden. With --device
cuda the same cases show what a GPU hides: the overlap loop's rates against the normal loop's. The
tiny model's forward is shorter than the host's work for a step, so there the host decides every rate;
--shape 0.6b runs a random-weight Qwen3-0.6B (tools/bench.py's, bf16) whose forward is longer, with the
tiny model's tokenizer.json copied in for the grammar: its 4096 tokens are the only ones a mask can allow
(a real vocabulary of 151k tokens costs the host more to fill), and it has no MTP layer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import PROMPTS  # noqa: E402  (the shipped benchmark prompts)

import torch  # noqa: E402

from minioverlap import LLM, SamplingParams  # noqa: E402
from minioverlap.constrained import grammar  # noqa: E402

REGEX = r"[0-9a-z_,.]{400}"             # no end before 400 characters: every request runs --tokens tokens
RANDOM_REGEX = r"[0-9a-z_,.]{1000}"     # a random model's tokens run long (up to 12 characters): 1000 are more than 64
KINDS = ("free", "grammar", "ngram", "mtp", "grammar-mtp")


class FillTimer:
    """Wraps a mask filler of the grammar module, token_bitmask (a plain step's) or window_bitmask (a verify
    window's; the sampler and mask_window import them at each call), to add up its host time."""

    def __init__(self, name: str) -> None:
        self.name, self.ns, self.calls, self.inner = name, 0, 0, getattr(grammar, name)

    def __call__(self, *args):
        start = time.perf_counter_ns()
        try:
            return self.inner(*args)
        finally:
            self.ns += time.perf_counter_ns() - start
            self.calls += 1


def checkpoint(args: argparse.Namespace) -> str:
    """The model to run: the shipped one, or a random-weight checkpoint of --shape with the tiny model's
    tokenizer (bench.py's, made once under --cache-dir)."""
    if args.shape == "tiny":
        return "tiny"
    from bench import make_checkpoint
    from minioverlap.model.loader import resolve_model_dir
    path = make_checkpoint(args.shape, args.cache_dir)
    if not (path / "tokenizer.json").is_file():
        shutil.copy(Path(resolve_model_dir("tiny")) / "tokenizer.json", path / "tokenizer.json")
    return str(path)


def run_case(kind: str, batch: int, overlap: bool, args: argparse.Namespace) -> dict:
    """One case: the median of --repeats runs after a warm-up -> its row of the table."""
    options = dict(overlap=overlap, max_running=16, chunked_prefill_size=-1, prefix_cache=False, device=args.device,
                   model=args.model, max_seq_len=1024)
    if kind == "ngram":
        options["ngram_steps"] = args.drafts
    if kind.endswith("mtp"):
        options["mtp_steps"] = args.drafts
    llm = LLM(**options)
    constrained = kind.startswith("grammar")
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, regex=args.regex if constrained else None)
    prompts = PROMPTS[:batch]
    timer = FillTimer("window_bitmask" if kind.endswith("mtp") else "token_bitmask")
    setattr(grammar, timer.name, timer)
    try:
        runs = []
        for i in range(args.repeats + 1):
            timer.ns = timer.calls = 0
            if kind == "ngram":
                llm.runner.lookup_ns.clear()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            short = [(len(o.token_ids), o.finish_reason) for o in outs if len(o.token_ids) != args.tokens]
            assert not short, f"{kind} batch {batch}: requests ended early: {short}"
            steps = len({e.step for e in llm.trace})
            runs.append(dict(wall=wall, steps=steps, phases=llm.trace.phase_times_us(), mask_ns=timer.ns,
                             fills=timer.calls, lookup=list(getattr(llm.runner, "lookup_ns", [])), outs=outs))
    finally:
        setattr(grammar, timer.name, timer.inner)
    runs = runs[1:]
    tokens = batch * args.tokens
    row = dict(case=f"b{batch}-{'overlap' if overlap else 'normal'}-{kind}", kind=kind, batch=batch,
               loop="overlap" if overlap else "normal", tokens=tokens,
               tok_s=round(statistics.median(tokens / r["wall"] for r in runs), 1),
               ms_step=round(statistics.median(r["wall"] / r["steps"] * 1e3 for r in runs), 3),
               phases_us={k: round(statistics.median(r["phases"].get(k, 0.0) for r in runs), 1)
                          for k in runs[0]["phases"]})
    if constrained:
        row["mask_us"] = round(statistics.median(r["mask_ns"] / r["fills"] / 1e3 for r in runs), 1)
        row["mask_us_per_req"] = round(row["mask_us"] / batch, 1)
    if kind == "ngram":
        row["lookup_us"] = round(statistics.median(statistics.mean(r["lookup"]) / 1e3 for r in runs), 1)
        row["lookup_us_per_req"] = round(row["lookup_us"] / batch, 1)
    if kind == "ngram" or kind.endswith("mtp"):
        outs = runs[-1]["outs"]
        row["accept_len"] = round(sum(len(o.token_ids) for o in outs) / sum(o.verify_steps for o in outs), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request (default 64)")
    ap.add_argument("--drafts", type=int, default=3, help="the n-gram drafter's drafts a step (default 3)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per case, after one warm-up (default 3)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--kinds", nargs="+", default=["free", "grammar", "ngram"], choices=KINDS,
                    help="the cases (default: free grammar ngram; mtp and grammar-mtp draft --drafts tokens with MTP)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--shape", default="tiny", choices=("tiny", "0.6b", "8b"), help="the model (default tiny)")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/minioverlap-ckpt"), help="where --shape's checkpoint is kept")
    ap.add_argument("--json", type=Path, help="write the results there (chapters/figures/19-cpu-waits.json)")
    args = ap.parse_args()
    if args.shape != "tiny" and any(k.endswith("mtp") for k in args.kinds):
        ap.error(f"--shape {args.shape} has no MTP layer: the mtp kinds need --shape tiny")
    args.model, args.regex = checkpoint(args), REGEX if args.shape == "tiny" else RANDOM_REGEX
    rows = [run_case(kind, batch, overlap, args) for batch in args.batches for kind in args.kinds
            for overlap in (False, True)]
    print(f"{'case':<22}{'tok/s':>8}{'ms/step':>9}{'mask us':>9}{'lookup us':>11}{'accept':>8}  phases (us)")
    for r in rows:
        phases = " ".join(f"{k} {v:.0f}" for k, v in r["phases_us"].items())
        print(f"{r['case']:<22}{r['tok_s']:>8.1f}{r['ms_step']:>9.2f}{r.get('mask_us', float('nan')):>9.1f}"
              f"{r.get('lookup_us', float('nan')):>11.1f}{r.get('accept_len', float('nan')):>8.2f}  {phases}")
    if args.json:
        created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S%z")
        args.json.write_text(json.dumps(dict(tool="tools/bench_waits.py", created=created, argv=sys.argv[1:], device=args.device,
                                             device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                                             model=args.shape, tokens=args.tokens, drafts=args.drafts, repeats=args.repeats,
                                             regex=args.regex, results=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
