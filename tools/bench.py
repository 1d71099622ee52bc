"""Chapters 14 and 15's benchmark: minioverlap against transformers on real Qwen3 shapes, on one GPU (needs CUDA).

    python tools/bench.py                                    # tiny, 0.6b and 8b, batch 1 4 16 64, every system
    python tools/bench.py --shapes 8b --batches 16 64 --cache-dir /tmp/ckpt --out bench.json   # add to a sweep
    python tools/bench.py --systems hf-compile overlap-graphs overlap-kernels --tokens 64 --repeats 5
    python tools/bench.py --report runs/bench.json               # no GPU: the table, and runs/bench.png, of a recorded run
    python tools/bench.py --shapes 8b --batches 1 --profile --chrome trace.json   # where a step's time goes
    python tools/bench.py --shapes tiny --mtp 3             # plain against MTP, the tiny model's own drafts
    python tools/bench.py --shapes 8b --first-token 1024 4096 16384 32768 --cache-dir /tmp/ckpt --out first.json

Each model shape is a random-weight Qwen3 checkpoint in bf16 with the real shapes (Qwen3-0.6B, Qwen3-8B),
made with transformers and saved to --cache-dir (reused there by later commands); the tiny shape is the
model minioverlap ships, trained, with its MTP layer, also run in bf16. For each shape and batch size
every system serves the same batch of --prompt-token prompts (random tokens; for tiny, windows of
minioverlap's own Python source, which its drafts can predict), each generating exactly --tokens new
tokens (greedy; transformers with min_new_tokens, minioverlap with ignore_eos): transformers eagerly
with its dynamic cache (hf-eager) and with a static cache, whose decode forward its generate compiles
with torch.compile (hf-compile, what a transformers user picks for speed), and minioverlap's normal and
overlap loops, each eager and with CUDA graphs on the reference path (kernels=False: -eager, -graphs),
and with graphs on chapter 15's fast path (-kernels); on a shape with an MTP layer (only tiny: random
weights would draft nothing useful), the graphed systems once more, drafting --mtp tokens a step (-mtp).
Each is warmed up untimed, then they take turns for --repeats timed runs; the table shows medians:
tokens/s, ms per token (wall time / new tokens, the prefill spread over the run: a step's time,
except for MTP, which commits several tokens a step), the first token's ms (a run of it alone: the
prefill) and a decode step's (what each further token adds: (wall - first) / (tokens - 1)), ms per
token against the HBM bound (the weight bytes a plain decode step reads over the copy bandwidth
measured in the same run) and against the datasheet's bound (the same bytes over the device's
datasheet bandwidth, DATASHEET_BPS), the ratio to hf-compile, for minioverlap the median GPU gap
between steps and the host's CPU time per step (every phase but `wait`: the mean over the run, and
the median over the decode steps), and for MTP the accept length (tok/pass: tokens per pass, the
prefill and the verify steps). Results are merged into --out
after each batch size, so a long sweep can run as several commands, and plotted to --png (tokens/s
against batch size; by default beside the JSON, --out's or --report's, named as it with .png). Each
shape runs in a process of its own.

--profile adds, per shape, the kernels of one graphed decode step at batch 1 (torch.profiler) on each
path, the reference (`profile`) and the fast one (`profile_kernels`): how many, their GPU time, and the
costliest by name; and the host's side of the same step on the fast path, plain and (tiny) with MTP
(`profile_host`): its work per step, and the Python functions with the most time of their own.
--chrome FILE writes both loops' event traces at batch 1 with graphs on the reference path (the first
shape) as Chrome trace-event JSON, the file chapter 06's notebook draws.

--first-token N [N ...] runs, instead of the batch table, the first token alone (the prefill and its
token) of one prompt of N random tokens at batch 1, for each N: transformers with its default
attention, asked for by name (hf-eager, attn_implementation="sdpa", recorded in the header), and
minioverlap's overlap loop with graphs on the reference path (overlap-graphs) and on the fast path,
whose prefill runs the extend kernel (overlap-kernels); --systems picks among these three. Each engine
takes the whole prompt in one step (chunked_prefill_size=-1: the number is the whole prefill), without
the prefix cache (the same prompt repeats), with room for the longest N. Each is warmed up untimed,
then they take turns for --repeats timed runs (ms_first: the median, ms_all: every run). Then, for
each N >= 4096, each minioverlap system runs the prompt again in chunks of --chunk tokens, one step a
chunk (an untimed run, then the one recorded), and chunk_ms is each step's GPU time, the span between
the CUDA timing events the engine records around every step on its forward stream (Trace.gpu): the
first chunk attends to no prefix, the last to the longest, so last/first is what the prefix adds to a
chunk. The rows go under "first_token" in --out, merged as the batch table's are, and the report
gives one table per shape, with the ratio to hf-eager at the same length.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SYSTEMS = ("hf-eager", "hf-compile", "normal-eager", "overlap-eager", "normal-graphs", "overlap-graphs",
           "normal-graphs-mtp", "overlap-graphs-mtp",
           "normal-kernels", "overlap-kernels", "normal-kernels-mtp", "overlap-kernels-mtp")
FIRST_TOKEN_SYSTEMS = ("hf-eager", "overlap-graphs", "overlap-kernels")   # what --first-token runs
CHUNKED_FROM = 4096                      # --first-token: the shortest prompt also run in chunks of --chunk
DATASHEET_BPS = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}   # HBM bytes/s by the device's name (SXM parts)
COMMON = dict(head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=151643, eos_token_id=151645)
SHAPES = {   # Qwen3-0.6B and Qwen3-8B; tiny is the shipped checkpoint
    "tiny": None,
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
}


def free() -> None:
    gc.collect()
    torch.compiler.reset()                 # hf-compile's graphs and their memory pools
    torch.cuda.empty_cache()


def copy_bandwidth(gib: int = 2, repeats: int = 9) -> float:
    """Bytes/s of a device-to-device copy of `gib` GiB, counting bytes read and written; median of `repeats`."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device="cuda")
    dst, seconds = torch.empty_like(src), []
    for i in range(repeats + 1):                          # the first copy warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i:
            seconds.append(start.elapsed_time(end) / 1e3)
    del src, dst
    free()
    return 2 * gib * 2**30 / statistics.median(seconds)


def make_checkpoint(shape: str, cache_dir: Path) -> Path:
    """A random-weight bf16 Qwen3 checkpoint of `shape`, built on the GPU (on the CPU where there is none:
    the same config, seed and initialization, other random numbers) and saved (once) under cache_dir; for
    tiny, the checkpoint minioverlap ships."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    if SHAPES[shape] is None:
        from minioverlap.model.loader import resolve_model_dir
        return Path(resolve_model_dir(shape))
    path = cache_dir / f"qwen3-{shape}-random"
    cache_dir.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").is_file():
        return path
    partial = path.with_name(path.name + ".partial")          # renamed when complete: a killed run leaves no half
    shutil.rmtree(partial, ignore_errors=True)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen3ForCausalLM(Qwen3Config(**SHAPES[shape], **COMMON))
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in model.parameters():                           # matrices N(0, 0.02), RMSNorm weights 1
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(partial)
    partial.rename(path)
    del model
    free()
    return path


def step_weight_bytes(path: Path) -> int:
    """Bytes of weights one plain decode step reads in bf16: every tensor once, the LM head included; the
    input embedding only when it is the (tied) head, as an untied one is only gathered, a row per token;
    not the MTP layers (model.layers.{L}.* with L >= num_hidden_layers)."""
    from safetensors import safe_open
    config = json.loads((path / "config.json").read_text())
    skip = "lm_head.weight" if config["tie_word_embeddings"] else "model.embed_tokens.weight"

    def read(name: str) -> bool:
        parts = name.split(".")
        mtp = parts[:2] == ["model", "layers"] and int(parts[2]) >= config["num_hidden_layers"]
        return name != skip and not mtp
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) * 2 for name in f.keys() if read(name))
    return total


def has_mtp(path: Path) -> bool:
    return json.loads((path / "config.json").read_text()).get("num_nextn_predict_layers", 0) > 0


def make_prompts(shape: str, path: Path, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` tokens, the same for every system: random ids below the special tokens,
    or, for tiny, windows of minioverlap's own source at spread offsets (code its drafts can predict)."""
    gen = torch.Generator().manual_seed(batch)
    if SHAPES[shape] is not None:
        return torch.randint(0, 151643, (batch, length), generator=gen).tolist()
    from minioverlap.model.loader import load_tokenizer
    package = Path(__file__).resolve().parents[1] / "minioverlap"
    text = "\n".join(f.read_text() for f in sorted(package.rglob("*.py")))
    ids = load_tokenizer(path).encode(text).ids
    starts = torch.randint(0, len(ids) - length, (batch,), generator=gen).tolist()
    return [ids[s:s + length] for s in starts]


def hf_system(model, prompts: list[list[int]], tokens: int, compiled: bool):
    """transformers' generate on one batch (the prompts are all --prompt long: no padding). With a static
    cache on CUDA, generate runs its decode steps through model.get_compiled_call() (torch.compile)."""
    ids = torch.tensor(prompts, device="cuda")
    extra = {"cache_implementation": "static"} if compiled else {}

    def run(n: int = tokens) -> None:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, **extra)
        assert out.shape == (len(prompts), ids.shape[1] + n)
        assert not compiled or hasattr(model, "_compiled_call"), "transformers did not compile the forward"
    return run, lambda: (None, None, None, None)


def minioverlap_system(path: Path, name: str, prompts: list[list[int]], tokens: int, mtp: int):
    """An engine of one loop (normal/overlap), eager, with CUDA graphs of the reference path, or with graphs
    of the fast path (chapter 15's kernels), drafting `mtp` tokens a step when the name ends in -mtp;
    probe: (median GPU gap, CPU ms/step, tokens per pass or None, a decode step's CPU ms)."""
    from minioverlap import LLM, SamplingParams
    loop, mode, *spec = name.split("-")
    k = mtp if spec else 0
    # prefix_cache=False: every timed run repeats the same prompts, and transformers, the baseline, computes
    # each prompt again; with the cache on, only the first run would prefill them.
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", overlap=loop == "overlap", cuda_graphs=mode != "eager",
              kernels=mode == "kernels", max_running=len(prompts), max_seq_len=len(prompts[0]) + tokens + 16, mtp_steps=k,
              prefix_cache=False)
    outs = []

    def run(n: int = tokens) -> None:
        outs[:] = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        assert all(len(o.token_ids) == n for o in outs)

    def probe() -> tuple[float | None, float, float | None, float | None]:
        gaps = llm.trace.gpu_gaps_ms()
        accept = sum(len(o.token_ids) for o in outs) / sum(o.verify_steps for o in outs) if k else None
        return (statistics.median(gaps) if gaps else None), llm.trace.host_ms_per_step(), accept, decode_host_ms(llm.trace)
    return run, probe


def decode_host_ms(trace) -> float | None:
    """The host's work of a typical decode step, in ms: each step's phases but `wait` (as
    Trace.host_ms_per_step counts them), the median over every step after the first, the prefill, whose
    eager launch the mean of host_ms_per_step spreads over the run."""
    per_step: dict[int, int] = {}
    for a, b in zip(trace, trace[1:]):
        if b.kind != "wait":
            per_step[b.step] = per_step.get(b.step, 0) + b.t_ns - a.t_ns
    decode = [ns for step, ns in per_step.items() if step > 1]
    return statistics.median(decode) / 1e6 if decode else None


def one_engine(shape: str, path: Path, prompt: int, tokens: int, **options):
    """A minioverlap engine at batch 1 with graphs on, its prompt and its sampling parameters."""
    from minioverlap import LLM, SamplingParams
    # prefix_cache=False: the same prompt runs again and again (warm-up, profile, timed runs); each must
    # prefill it, as transformers does
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", cuda_graphs=True, max_running=1,
              max_seq_len=prompt + tokens + 16, prefix_cache=False, **{"kernels": False, **options})
    return llm, make_prompts(shape, path, 1, prompt), SamplingParams(max_tokens=tokens, ignore_eos=True)


def profile_step(shape: str, path: Path, prompt: int, tokens: int = 64, top: int = 8, kernels: bool = False) -> dict:
    """The GPU kernels of a graphed decode step at batch 1 (normal loop, the prefill's share spread over
    `tokens` steps), on the reference path or the fast path: kernels per step, their GPU time per step,
    and the `top` costliest names."""
    from torch.profiler import ProfilerActivity, profile
    llm, prompts, params = one_engine(shape, path, prompt, tokens, overlap=False, kernels=kernels)
    llm.generate(prompts, params)                                        # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.count > 0]
    total_us = sum(e.device_time_total for e in kernels)
    costliest = sorted(kernels, key=lambda e: -e.device_time_total)[:top]
    return {"kernels_per_step": round(sum(e.count for e in kernels) / tokens, 1),
            "gpu_ms_per_step": round(total_us / tokens / 1e3, 4),
            "top": [{"name": e.key[:80], "ms_per_step": round(e.device_time_total / tokens / 1e3, 4),
                     "per_step": round(e.count / tokens, 1)} for e in costliest]}


def profile_host(shape: str, path: Path, prompt: int, tokens: int = 64, top: int = 15, **options) -> dict:
    """The host's side of a graphed decode step at batch 1 on the fast path (normal loop): its work per step
    from the trace, then the `top` functions by their own time under cProfile (which slows Python down
    more than the device calls: the ranking is what it is for), per step."""
    import cProfile
    import pstats
    llm, prompts, params = one_engine(shape, path, prompt, tokens, overlap=False, **{"kernels": True, **options})
    llm.generate(prompts, params)                                        # warm-up
    llm.generate(prompts, params)
    host_ms = llm.trace.host_ms_per_step()
    profiler = cProfile.Profile()
    profiler.runcall(llm.generate, prompts, params)
    stats = pstats.Stats(profiler).stats
    costliest = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]   # (file, line, name): (cc, calls, tottime, ...)
    return {"host_ms_per_step": round(host_ms, 4),
            "top": [{"function": f"{Path(file).name}:{line}({name})"[:80], "ms_per_step": round(tt / tokens * 1e3, 4),
                     "calls_per_step": round(calls / tokens, 1)} for (file, line, name), (_, calls, tt, *_) in costliest]}


def chrome(shape: str, path: Path, prompt: int, tokens: int, out: Path) -> None:
    """Both loops' event traces at batch 1, graphs on, as Chrome trace-event JSON."""
    from minioverlap.device.trace import chrome_trace
    traces, starts = {}, {}
    for loop in ("normal", "overlap"):
        llm, prompts, params = one_engine(shape, path, prompt, tokens, overlap=loop == "overlap")
        llm.generate(prompts, params)                                    # warm-up
        starts[loop] = time.perf_counter_ns()
        llm.generate(prompts, params)
        traces[loop] = llm.trace
        del llm
        free()
    out.write_text(json.dumps(chrome_trace(traces, starts)) + "\n")
    print(f"wrote {out}")


def race(systems: dict, repeats: int) -> dict[str, list[tuple]]:
    """One untimed warm-up each, then `repeats` rounds taking turns -> (wall s, *probe(), first s) per timed
    run: a run of every token, its probe, then a run of the first token alone (the prefill and its token)."""
    for run, _ in systems.values():
        run()
        run(1)
    samples: dict[str, list[tuple]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, (run, probe) in systems.items():
            wall = timed(run)
            samples[name].append((wall, *probe(), timed(lambda: run(1))))
    return samples


def timed(fn) -> float:
    """Seconds fn takes, the GPU's queued work included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def datasheet_bps(device: str) -> float | None:
    """The HBM bandwidth of the device's datasheet, if DATASHEET_BPS knows it."""
    return next((bps for name, bps in DATASHEET_BPS.items() if name in device), None)


def row(shape: str, batch: int, system: str, samples: list[tuple], tokens: int, weight_bytes: int, bw: float,
        mtp: int, datasheet: float | None = None) -> dict:
    """hbm_ms: the weight bytes over the copy bandwidth measured in the run; bound_ms: over the datasheet's.
    ms_first: a run of the first token alone (the prefill); ms_decode: what each further token adds,
    (wall - first) / (tokens - 1), the decode step without the prefill that ms_step spreads over the run."""
    wall = statistics.median(s[0] for s in samples)
    ms_step, hbm_ms = wall / tokens * 1e3, weight_bytes / bw * 1e3
    bound_ms = weight_bytes / datasheet * 1e3 if datasheet else None
    gap, cpu, accept, decode_cpu, first = (median_or_none([s[i] for s in samples]) for i in (1, 2, 3, 4, 5))
    decode = (wall - first) / (tokens - 1) * 1e3 if first is not None and tokens > 1 else None
    return {"shape": shape, "batch": batch, "system": system, "tok_s": round(batch * tokens / wall, 1),
            "ms_step": round(ms_step, 4), "ms_first": rounded(first and first * 1e3), "ms_decode": rounded(decode),
            "hbm_ms": round(hbm_ms, 6), "x_hbm": round(ms_step / hbm_ms, 3),
            "bound_ms": rounded(bound_ms, 6), "x_bound": rounded(bound_ms and ms_step / bound_ms, 3),
            "gap_ms": rounded(gap), "cpu_ms": rounded(cpu), "cpu_ms_decode": rounded(decode_cpu),
            "weights_GB": round(weight_bytes / 1e9, 3),
            **({"mtp": mtp, "accept": rounded(accept, 3)} if system.endswith("-mtp") else {})}


def order(r: dict, size: str = "batch") -> tuple:
    """A row's place: shape, then its size (the batch table's batch, the first-token sweep's prompt), then system."""
    shapes = list(SHAPES)
    return (shapes.index(r["shape"]) if r["shape"] in shapes else len(shapes), r["shape"], r[size],
            SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else len(SYSTEMS), r["system"])


class MergeError(ValueError):
    """Two runs that cannot share a table."""


def first_order(r: dict) -> tuple:
    return order(r, "prompt")


def merge(old: dict | None, new: dict) -> dict:
    """new's rows added to old's, a configuration measured again replacing its old row: the batch table's
    (results, by shape, batch and system) and the first-token sweep's (first_token, by shape, prompt and
    system); the header (versions, copy bandwidth, attention) is new's. Another device does not mix, nor,
    between two batch tables, another prompt length or token count: MergeError."""
    if old is None:
        return new
    for key in ("device", "prompt", "tokens") if "results" in old and "results" in new else ("device",):
        if old.get(key) != new.get(key):
            raise MergeError(f"the recorded run has {key} {old.get(key)!r}, this one {new.get(key)!r}: use another --out")
    merged = {**old, **new}
    for field, key in (("results", order), ("first_token", first_order)):
        if field in merged:
            rows = {key(r): r for r in old.get(field, [])} | {key(r): r for r in new.get(field, [])}
            merged[field] = [rows[k] for k in sorted(rows)]
    return merged


def bench(args: argparse.Namespace, out: Path, cache: Path) -> dict:
    """Run every (shape, batch, system), merging the results into `out` after each batch size."""
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.first_token:
        return first_token(args, out, cache)
    bw = copy_bandwidth()
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
              "copy_GBps": round(bw / 1e9, 1), "prompt": args.prompt, "tokens": args.tokens}
    record = merge(load(out), {**header, "results": []})          # a mismatch stops the run before it starts
    for shape in args.shapes:
        path = make_checkpoint(shape, cache)
        weight_bytes = step_weight_bytes(path)
        names = [s for s in args.systems if has_mtp(path) or not s.endswith("-mtp")]
        hf = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda").eval()
              if any(s.startswith("hf-") for s in names) else None)
        for batch in args.batches:
            begin = time.perf_counter()
            prompts = make_prompts(shape, path, batch, args.prompt)
            systems = {s: hf_system(hf, prompts, args.tokens, s == "hf-compile") if s.startswith("hf-")
                       else minioverlap_system(path, s, prompts, args.tokens, args.mtp) for s in names}
            samples = race(systems, args.repeats)
            del systems
            free()
            rows = [row(shape, batch, s, samples[s], args.tokens, weight_bytes, bw, args.mtp,
                        datasheet_bps(header["device"])) for s in names]
            record = merge(record, {**header, "results": rows})
            out.write_text(json.dumps(record, indent=1) + "\n")
            print(f"{shape} batch {batch}: {time.perf_counter() - begin:.0f} s", flush=True)
        del hf
        free()
        if args.profile:
            record.setdefault("profile", {})[shape] = profile_step(shape, path, args.prompt)
            record.setdefault("profile_kernels", {})[shape] = profile_step(shape, path, args.prompt, kernels=True)
            host = {"plain": profile_host(shape, path, args.prompt)}
            if has_mtp(path):
                host["mtp"] = profile_host(shape, path, args.prompt, mtp_steps=args.mtp)
            record.setdefault("profile_host", {})[shape] = host
            out.write_text(json.dumps(record, indent=1) + "\n")
        if args.chrome:
            chrome(shape, path, args.prompt, 32, Path(args.chrome))
    return record


def first_token(args: argparse.Namespace, out: Path, cache: Path) -> dict:
    """For each shape: the first token of a prompt of each --first-token length, the systems taking turns;
    then each minioverlap system's runs in chunks (lengths >= CHUNKED_FROM). Merged into `out` after each."""
    import transformers
    from transformers import AutoModelForCausalLM
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "hf_attention": "sdpa"}
    record = merge(load(out), {**header, "first_token": []})         # a mismatch stops the run before it starts
    longest = max(args.first_token)
    for shape in args.shapes:
        path = make_checkpoint(shape, cache)
        hf = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                                   attn_implementation=header["hf_attention"]).eval()
              if "hf-eager" in args.systems else None)
        engines = {s: first_token_engine(path, s, longest) for s in args.systems if s != "hf-eager"}
        rows = {}
        for prompt in args.first_token:
            prompts = make_prompts(shape, path, 1, prompt)
            runs = {s: hf_system(hf, prompts, 1, compiled=False)[0] if s == "hf-eager" else
                    first_token_run(engines[s], prompts) for s in args.systems}
            ms = race_first(runs, args.repeats)
            rows |= {(prompt, s): first_token_row(shape, prompt, s, ms[s], args.chunk) for s in args.systems}
            record = save(out, merge(record, {**header, "first_token": list(rows.values())}))
            print(f"{shape} first token, {prompt}-token prompt: " +
                  ", ".join(f"{s} {rows[prompt, s]['ms_first']:.1f} ms" for s in args.systems), flush=True)
        del hf, engines, runs
        free()
        for s in (s for s in args.systems if s != "hf-eager"):
            llm = first_token_engine(path, s, longest, args.chunk)        # one engine at a time: the memory
            for prompt in (p for p in args.first_token if p >= CHUNKED_FROM):
                rows[prompt, s]["chunk_ms"] = chunk_ms(llm, make_prompts(shape, path, 1, prompt), args.chunk)
            record = save(out, merge(record, {**header, "first_token": list(rows.values())}))
            del llm
            free()
    return record


def first_token_engine(path: Path, name: str, longest: int, chunk: int = -1):
    """An overlap-loop engine at batch 1 with graphs, on the reference path or (overlap-kernels) the fast
    one, taking a prompt in chunks of `chunk` tokens (-1: whole, in one step)."""
    from minioverlap import LLM
    # prefix_cache=False: the same prompt runs again and again, and transformers prefills it every time
    return LLM(model=str(path), device="cuda", dtype="bfloat16", overlap=True, cuda_graphs=True,
               kernels=name == "overlap-kernels", max_running=1, max_seq_len=longest + 1 + 16, prefix_cache=False,
               chunked_prefill_size=chunk)


def first_token_run(llm, prompts: list[list[int]]):
    """A run of the prompt to its first token."""
    from minioverlap import SamplingParams
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def run() -> None:
        assert [len(o.token_ids) for o in llm.generate(prompts, params)] == [1]
    return run


def race_first(runs: dict, repeats: int) -> dict[str, list[float]]:
    """As race: one untimed warm-up each, then `repeats` rounds taking turns -> ms of each timed run."""
    for run in runs.values():
        run()
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            ms[name].append(timed(run) * 1e3)
    return ms


def first_token_row(shape: str, prompt: int, system: str, ms_all: list[float], chunk: int) -> dict:
    return {"shape": shape, "prompt": prompt, "system": system, "ms_first": rounded(median_or_none(ms_all)),
            "ms_all": [rounded(ms) for ms in ms_all], "chunk": chunk}


def chunk_ms(llm, prompts: list[list[int]], chunk: int) -> list[float]:
    """The GPU ms of each step of a run of the prompt in chunks (the engine's chunk size), after an untimed one."""
    run = first_token_run(llm, prompts)
    run()
    run()
    return step_ms(llm.trace, math.ceil(len(prompts[0]) / chunk))


def step_ms(trace, steps: int) -> list[float]:
    """Each step's GPU ms, from the spans the engine records in trace.gpu on a GPU; a run in chunks has a
    step per chunk, the last sampling the token, and no other."""
    spans = [end - start for _, (start, end) in sorted(trace.gpu.items())]
    if len(spans) != steps:
        raise RuntimeError(f"a run of {steps} chunks has GPU spans of {len(spans)} steps")
    return [rounded(ms) for ms in spans]


def save(out: Path, record: dict) -> dict:
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def report(record: dict) -> None:
    """One rich table per shape: rows batch x system, with the tokens/s ratio to hf-compile at the same batch;
    then, for a first-token sweep, one per shape of its rows (report_first_token)."""
    from rich.console import Console
    from rich.table import Table
    console = Console(width=None if sys.stdout.isatty() else 160)
    results = sorted(record.get("results", []), key=order)
    base = {(r["shape"], r["batch"]): r["tok_s"] for r in results if r["system"] == "hf-compile"}
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = [r for r in results if r["shape"] == shape]
        weights = "trained weights (the shipped model)" if shape == "tiny" else "random weights"
        bound = f" (copy bandwidth), datasheet bound {rows[0]['bound_ms']:.3f}" if rows[0].get("bound_ms") else ""
        table = Table(title=f"Qwen3-{shape} shape, {weights}, bf16: {rows[0]['weights_GB']:.2f} GB read per step, "
                            f"HBM bound {rows[0]['hbm_ms']:.3f} ms/step{bound}",
                      caption=f"{record['device']}, torch {record['torch']}, transformers {record['transformers']}, "
                              f"copy {record['copy_GBps']:.0f} GB/s; {record['prompt']}-token prompts, "
                              f"{record['tokens']} new tokens each; medians")
        datasheet = any(r.get("x_bound") for r in rows)
        split = any(r.get("ms_decode") for r in rows)     # a run recorded before the first token was timed: no
        columns = ["batch", "system", "tok/s", "ms/token"] + ["first ms", "decode ms"] * split + ["x HBM"] + [
            "x datasheet"] * datasheet + ["x hf-compile", "GPU gap ms", "CPU ms/step"] + ["CPU ms/decode"] * split
        mtp = any("accept" in r for r in rows)
        for name in columns + ["tok/pass"] * mtp:
            table.add_column(name, justify="left" if name == "system" else "right")
        for i, r in enumerate(rows):
            ratio = r["tok_s"] / base[shape, r["batch"]] if (shape, r["batch"]) in base else None
            last = i + 1 == len(rows) or rows[i + 1]["batch"] != r["batch"]
            system = f"{r['system']} k={r['mtp']}" if "mtp" in r else r["system"]
            cells = [str(r["batch"]), system, f"{r['tok_s']:.0f}", f"{r['ms_step']:.2f}",
                     *[fmt(r.get("ms_first"), ".1f"), fmt(r.get("ms_decode"), ".2f")] * split, f"{r['x_hbm']:.2f}",
                     *[fmt(r.get("x_bound"), ".2f")] * datasheet, fmt(ratio, ".2f", "x"), fmt(r["gap_ms"], ".3f"),
                     fmt(r["cpu_ms"], ".3f"), *[fmt(r.get("cpu_ms_decode"), ".3f")] * split]
            table.add_row(*cells, *[fmt(r.get("accept"), ".2f")] * mtp, end_section=last)
        console.print(table)
        for key, path in (("profile", ""), ("profile_kernels", " on the fast path")):
            if shape in record.get(key, {}):
                prof = record[key][shape]
                console.print(f"a graphed decode step at batch 1{path}: {prof['kernels_per_step']:.0f} kernels, "
                              f"{prof['gpu_ms_per_step']:.3f} ms of GPU time; the costliest:")
                for k in prof["top"]:
                    console.print(f"  {k['ms_per_step']:7.3f} ms  {k['per_step']:5.0f} x  {k['name']}")
        for kind, prof in record.get("profile_host", {}).get(shape, {}).items():
            console.print(f"the host's side of a graphed step at batch 1, fast path, {kind}: {prof['host_ms_per_step']:.3f} "
                          f"ms of host work a step; under cProfile, the functions with the most time of their own:")
            for k in prof["top"]:
                console.print(f"  {k['ms_per_step']:7.3f} ms  {k['calls_per_step']:6.1f} x  {k['function']}")
    if "first_token" in record:
        report_first_token(console, record)


def report_first_token(console, record: dict) -> None:
    """One table per shape: rows prompt length x system, the first token's ms and its ratio to hf-eager at
    the same length; for rows run in chunks, the first and the last chunk's GPU ms and last/first."""
    from rich.table import Table
    rows = sorted(record["first_token"], key=first_order)
    base = {(r["shape"], r["prompt"]): r["ms_first"] for r in rows if r["system"] == "hf-eager"}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        chunks = sorted({r["chunk"] for r in mine if r.get("chunk_ms")})
        weights = "trained weights (the shipped model)" if shape == "tiny" else "random weights"
        caption = (f"{record['device']}, torch {record['torch']}, transformers {record['transformers']} "
                   f"({record.get('hf_attention', '-')} attention); batch 1, one new token, the prompt in one step; "
                   f"medians" + (f"; in chunks of {', '.join(map(str, chunks))} tokens: one run's GPU ms of the first "
                                 "chunk step (no prefix) and of the last (the longest prefix)" if chunks else ""))
        table = Table(title=f"Qwen3-{shape} shape, {weights}, bf16: the first token (the prefill) by prompt length",
                      caption=caption)
        for name in ["prompt", "system", "first ms", "x hf-eager"] + ["first chunk ms", "last chunk ms",
                                                                       "last/first"] * bool(chunks):
            table.add_column(name, justify="left" if name == "system" else "right")
        for i, r in enumerate(mine):
            ratio = r["ms_first"] / base[shape, r["prompt"]] if (shape, r["prompt"]) in base else None
            first, last = (r["chunk_ms"][0], r["chunk_ms"][-1]) if r.get("chunk_ms") else (None, None)
            cells = [str(r["prompt"]), r["system"], fmt(r["ms_first"], ".1f"), fmt(ratio, ".2f", "x"),
                     *[fmt(first, ".1f"), fmt(last, ".1f"), fmt(first and last / first, ".2f", "x")] * bool(chunks)]
            table.add_row(*cells, end_section=i + 1 == len(mine) or mine[i + 1]["prompt"] != r["prompt"])
        console.print(table)


def plot(record: dict, path: Path) -> None:
    """tokens/s against batch size, one line per system, one panel per shape, log axes."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {path}")
        return
    results = sorted(record["results"], key=order)
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in results if r["shape"] == shape]
        for system in dict.fromkeys(r["system"] for r in rows):
            points = [(r["batch"], r["tok_s"]) for r in rows if r["system"] == system]
            color = f"C{SYSTEMS.index(system)}" if system in SYSTEMS else None      # the same colour in every panel
            ax.plot(*zip(*points), marker="o", label=system, color=color)
        batches = sorted({r["batch"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="batch size", ylabel="tokens/s", title=f"Qwen3-{shape} shape")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{record['device']}: {record['prompt']}-token prompts, {record['tokens']} new tokens, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), metavar="SHAPE",
                        help=f"model shapes: {', '.join(SHAPES)} (default all)")
    parser.add_argument("--batches", nargs="+", type=positive, default=[1, 4, 16, 64], help="batch sizes")
    parser.add_argument("--prompt", type=positive, default=64, help="prompt tokens per request")
    parser.add_argument("--tokens", type=positive, default=128, help="new tokens per request")
    parser.add_argument("--repeats", type=positive, default=3, help="timed runs of each, taking turns")
    parser.add_argument("--mtp", type=positive, default=3, metavar="K",
                        help="tokens the -mtp systems draft a step, on shapes with an MTP layer (default 3)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, metavar="SYSTEM",
                        help=f"what runs: {', '.join(SYSTEMS)} (default all; with --first-token, "
                             f"{', '.join(FIRST_TOKEN_SYSTEMS)})")
    parser.add_argument("--first-token", nargs="+", type=positive, metavar="N",
                        help="instead of the batch table: the first token of one prompt of each length N, batch 1")
    parser.add_argument("--chunk", type=positive, default=2048,
                        help=f"with --first-token: the chunk of the chunked runs, for N >= {CHUNKED_FROM} (default 2048)")
    parser.add_argument("--cache-dir", help="where the checkpoints are made and kept for later runs (default: a temp dir, removed)")
    parser.add_argument("--out", default="bench.json", help="the JSON the results are merged into")
    parser.add_argument("--png", help="the plot (default: beside the JSON, --out's or --report's, ending .png)")
    parser.add_argument("--profile", action="store_true", help="also profile one graphed decode step per shape")
    parser.add_argument("--chrome", metavar="FILE", help="also write both loops' traces (first shape, batch 1, graphs)")
    parser.add_argument("--report", metavar="FILE", help="no run: print the table (and plot) of a recorded JSON")
    return checked_systems(parser, parser.parse_args(argv))


def checked_systems(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """--systems by mode, all of a mode's by default: the batch table runs any of SYSTEMS, --first-token
    only FIRST_TOKEN_SYSTEMS, and profiles nothing (--profile and --chrome profile decode steps)."""
    if not args.first_token:
        args.systems = args.systems or list(SYSTEMS)
        return args
    wrong = [s for s in args.systems or [] if s not in FIRST_TOKEN_SYSTEMS]
    if wrong:
        parser.error(f"argument --systems: with --first-token, choose from {', '.join(FIRST_TOKEN_SYSTEMS)}, "
                     f"not {wrong[0]!r}")
    if args.profile or args.chrome:
        parser.error("argument --first-token: not with --profile or --chrome, which profile the batch table's decode steps")
    args.systems = args.systems or list(FIRST_TOKEN_SYSTEMS)
    return args


def shape_by_shape(args: argparse.Namespace) -> dict:
    """Each shape in a process of its own, merging into the same --out (--chrome for the first shape):
    one process running the 8b shape and then the 0.6b one failed once with an illegal memory access."""
    for i, shape in enumerate(args.shapes):
        cmd = [sys.executable, __file__, "--shapes", shape, "--batches", *map(str, args.batches),
               "--prompt", str(args.prompt), "--tokens", str(args.tokens), "--repeats", str(args.repeats),
               "--mtp", str(args.mtp), *(["--first-token", *map(str, args.first_token)] if args.first_token else []),
               "--chunk", str(args.chunk),
               "--systems", *args.systems, "--out", args.out, *(["--png", args.png] if args.png else []),
               *(["--cache-dir", args.cache_dir] if args.cache_dir else []), *(["--profile"] if args.profile else []),
               *(["--chrome", args.chrome] if args.chrome and i == 0 else [])]
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"the {shape} run failed: {' '.join(cmd)}")
    return load(Path(args.out))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        record = load(Path(args.report))
        if record is None:
            raise SystemExit(f"--report {args.report}: no such file")
    elif not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA GPU; --report FILE reads a recorded run")
    elif len(args.shapes) > 1:
        record = shape_by_shape(args)
    else:
        try:
            with tempfile.TemporaryDirectory(prefix="bench-") as tmp:        # the checkpoints, without --cache-dir
                record = bench(args, Path(args.out), Path(args.cache_dir or tmp))
        except MergeError as e:
            raise SystemExit(f"--out {args.out}: {e}") from e
    report(record)
    if record.get("results"):                 # a first-token sweep alone has no batch sizes to plot
        plot(record, png_path(args))


def png_path(args: argparse.Namespace) -> Path:
    """--png, or the JSON read (--report) or written (--out) with the suffix .png, in the JSON's folder."""
    return Path(args.png) if args.png else Path(args.report or args.out).with_suffix(".png")


if __name__ == "__main__":
    main()
