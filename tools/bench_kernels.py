"""Chapter 15's kernel benchmark: each fast-path kernel against the PyTorch code it replaces (needs CUDA).

    python tools/bench_kernels.py                              # the 0.6b and 8b shapes, batch 1 and 16
    python tools/bench_kernels.py --shapes 8b --batches 1 --contexts 128 4096 --out kernels.json
    python tools/bench_kernels.py --report kernels.json        # no GPU: the table of a recorded run
    python tools/bench_kernels.py --shapes 8b --splits 1 2 4 8 16 32 --batches 1 16 64 --out splits.json
    python tools/bench_kernels.py --extend --out chapters/figures/18-h100-extend.json   # prefill attention

For each model shape (the layer sizes of Qwen3-0.6B and Qwen3-8B, bf16), batch size and context length,
every group of operations the fast path fuses runs both ways on the same random inputs: the reference
(the PyTorch code of minioverlap/model/qwen3.py and minioverlap/engine/attention.py) and the fast path
(minioverlap/kernels/, the merged projections). Each is captured in a CUDA graph of --repeats copies
and replayed, as it runs inside a graphed decode step, so the time is the GPU's, launch costs aside:
microseconds per call, median of 5 replays. Before timing, the two outputs are compared (bf16: within
two roundings of the largest value). Without CUDA, `check_cases` runs every case in Triton's
interpreter on a small shape (the tools' tests do).

--splits times only the decode attention, once for each number of splits of the context: what the
engine's fixed count (kernels/attention.py, num_splits) costs or saves at each batch size and context.

--extend times a prefill's attention (the 8B's heads: 32 query and 8 KV heads of 128): one prompt of
each --prompt-lens length, a --chunk of new tokens after a cached prefix of --chunk-prefix and after
none, 16 prompts of 64 tokens, and a mixed step (the chunk and 8 decode rows at that prefix), each with
chapter 18's extend kernel, the FlashAttention-shaped one (kernels/flash_extend.py; --extend-configs
adds a sweep of its block sizes), the reference (one masked SDPA) and, for one request, PyTorch's SDPA
backends on K and V already gathered and expanded to the query heads (is_causal, or lower-right causal
after a prefix). Each output is first compared with the reference; the time is triton.testing.do_bench's
median, and TFLOP/s counts 4 * Hq * D flops for every (query, visible key) pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

SHAPES = {   # hidden, intermediate, q heads, kv heads, head_dim: Qwen3-0.6B, Qwen3-8B, and a small one for tests
    "0.6b": (1024, 3072, 16, 8, 128),
    "8b": (4096, 12288, 32, 8, 128),
    "small": (64, 96, 4, 2, 16),
}


def attention_inputs(shape: str, batch: int, context: int, device: str, dtype: torch.dtype,
                     g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A decode step's attention at `context` keys a request: q [B, Hq, D], the K and V pools (16 slots to
    spare), a page table of distinct random slots, and each request's position, the last key's."""
    hq, hkv, d = SHAPES[shape][2:]
    slots = batch * context + 16
    k_pool, v_pool = (torch.randn(slots, hkv, d, generator=g).to(device=device, dtype=dtype) for _ in "kv")
    table = torch.randperm(slots, generator=g)[:batch * context].view(batch, context).to(device=device, dtype=torch.int32)
    q = torch.randn(batch, hq, d, generator=g).to(device=device, dtype=dtype)
    return q, k_pool, v_pool, table, torch.full((batch,), context - 1, device=device)


def cases(shape: str, batch: int, context: int, device: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[Callable, Callable]]:
    """name -> (reference, fast path): zero-argument functions over the same inputs, each returning its output."""
    from minioverlap.engine.attention import decode_attention, window_attention
    from minioverlap.kernels.attention import paged_attention
    from minioverlap.kernels.elementwise import add_rms_norm, qk_norm_rope, silu_mul
    from minioverlap.kernels.kv_store import store_kv
    from minioverlap.model.qwen3 import apply_rope, rope_cos_sin
    hidden, inter, hq, hkv, d = SHAPES[shape]
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, 1e-6)

    x, r, w = randn(batch, hidden), randn(batch, hidden), randn(hidden)
    w_q, w_k, w_v = randn(hq * d, hidden) * 0.02, randn(hkv * d, hidden) * 0.02, randn(hkv * d, hidden) * 0.02
    w_qkv = torch.cat([w_q, w_k, w_v])
    w_gate, w_up = randn(inter, hidden) * 0.02, randn(inter, hidden) * 0.02
    w_gate_up = torch.cat([w_gate, w_up])
    qkv, norms = randn(batch, (hq + 2 * hkv) * d), randn(2, d)
    gate_up = randn(batch, 2 * inter)
    q, k_pool, v_pool, table, positions = attention_inputs(shape, batch, context, device, dtype, g)
    cos, sin = rope_cos_sin(positions, d, 1e6)
    loc = torch.randperm(len(k_pool), generator=g)[:batch].to(device)
    k_new, v_new = randn(batch, hkv, d), randn(batch, hkv, d)
    seq_lens = torch.full((batch,), context, device=device)
    window = 4
    q_w = randn(batch * window, hq, d)
    positions_w = (torch.arange(window, device=device) + context - window).repeat(batch)

    def qk_reference() -> torch.Tensor:
        q_, k_ = qkv[:, :hq * d].view(batch, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(batch, hkv, d)
        c, s = cos.to(dtype), sin.to(dtype)
        return torch.cat([apply_rope(rms(q_, norms[0]), c, s), apply_rope(rms(k_, norms[1]), c, s)], dim=1)

    def store_reference() -> torch.Tensor:
        k_pool[loc], v_pool[loc] = k_new, v_new
        return k_pool[loc]

    def store_fast() -> torch.Tensor:
        store_kv(k_pool, v_pool, loc, k_new, v_new)
        return k_pool[loc]

    return {
        "q/k/v projections": (lambda: torch.cat([F.linear(x, w_q), F.linear(x, w_k), F.linear(x, w_v)], dim=1),
                              lambda: F.linear(x, w_qkv)),
        "gate/up projections": (lambda: torch.cat([F.linear(x, w_gate), F.linear(x, w_up)], dim=1),
                                lambda: F.linear(x, w_gate_up)),
        "add + RMSNorm": (lambda: rms(x + r, w), lambda: add_rms_norm(x, r.clone(), w, 1e-6)[0]),
        "q/k norm + RoPE": (qk_reference, lambda: torch.cat(qk_norm_rope(qkv, norms, cos, sin, hq, hkv, 1e-6)[:2], dim=1)),
        "SiLU x up": (lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:], lambda: silu_mul(gate_up)),
        "KV store": (store_reference, store_fast),
        "decode attention": (lambda: decode_attention(q, k_pool, v_pool, table, seq_lens),
                             lambda: paged_attention(q, k_pool, v_pool, table, None, positions, 1)),
        f"verify attention, {window} rows": (lambda: window_attention(q_w, k_pool, v_pool, table, positions_w),
                                             lambda: paged_attention(q_w, k_pool, v_pool, table, None, positions_w, window)),
    }


def close(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, after checking it is within two bf16 roundings of the largest value."""
    err = (got.float() - want.float()).abs().max().item()
    limit = 2 * 2 ** -7 * max(1.0, want.abs().max().item())
    if err > limit:
        raise AssertionError(f"max error {err:.3g} > {limit:.3g}")
    return err


def check_cases(shape: str, batch: int, context: int, device: str) -> dict[str, float]:
    """Every case's reference and fast path compared -> name: max error."""
    return {name: close(fast(), ref()) for name, (ref, fast) in cases(shape, batch, context, device).items()}


def graph_us(fn: Callable, repeats: int) -> float:
    """fn captured `repeats` times in one CUDA graph; microseconds per call, median of 5 replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeats)
    return statistics.median(times[1:])


def bench(args: argparse.Namespace) -> dict:
    rows = []
    for shape in args.shapes:
        for batch in args.batches:
            for context in args.contexts:
                errors = check_cases(shape, batch, context, "cuda")
                for name, (ref, fast) in cases(shape, batch, context, "cuda").items():
                    if "attention" not in name and context != args.contexts[0]:
                        continue                           # only attention depends on the context
                    rows.append({"shape": shape, "batch": batch, "context": context, "case": name,
                                 "reference_us": round(graph_us(ref, args.repeats), 2),
                                 "fast_us": round(graph_us(fast, args.repeats), 2), "max_error": errors[name]})
                    print(rows[-1], flush=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "repeats": args.repeats, "results": rows}


def bench_splits(args: argparse.Namespace) -> dict:
    """The decode attention of each shape, batch size and context, split each of args.splits ways:
    microseconds per call inside a CUDA graph, as `bench` times it."""
    from minioverlap.kernels.attention import paged_attention
    rows = []
    for shape in args.shapes:
        for batch in args.batches:
            for context in args.contexts:
                g = torch.Generator(device="cpu").manual_seed(0)
                q, k_pool, v_pool, table, positions = attention_inputs(shape, batch, context, "cuda", torch.bfloat16, g)
                for splits in args.splits:
                    us = graph_us(lambda: paged_attention(q, k_pool, v_pool, table, None, positions, 1, splits=splits),
                                  args.repeats)
                    rows.append({"shape": shape, "batch": batch, "context": context, "splits": splits, "us": round(us, 2)})
                    print(rows[-1], flush=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "repeats": args.repeats, "splits": rows}


EXTEND_SWEEP = ["128,64,8,2", "128,64,8,3", "128,64,8,4", "128,128,8,2", "128,128,8,3", "128,64,4,3", "128,32,8,3",
                "64,64,4,3", "64,64,4,4", "64,32,4,3"]


def extend_inputs(heads: tuple[int, int, int], prefix_lens: list[int], extend_lens: list[int], device: str,
                  dtype: torch.dtype, g: torch.Generator, page_size: int = 16) -> tuple:
    """A ragged prefill as the engine lays it out: each request's prefix + new tokens in pages of
    page_size scattered over a pool, q [T, Hq, D], the new k, v [T, Hkv, D] (already in the pool) and
    the step's ExtendIndices."""
    from minioverlap.engine.attention import extend_indices
    hq, hkv, d = heads
    kv_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    pages = [-(-n // page_size) for n in kv_lens]
    order = torch.randperm(sum(pages), generator=g)
    table = torch.zeros(len(kv_lens), max(kv_lens), dtype=torch.int64)
    for b, (n, first) in enumerate(zip(kv_lens, [sum(pages[:b]) for b in range(len(pages))])):
        pos = torch.arange(n)
        table[b, :n] = order[first + pos // page_size] * page_size + pos % page_size
    k_pool, v_pool = (torch.randn(sum(pages) * page_size, hkv, d, generator=g).to(device=device, dtype=dtype) for _ in "kv")
    table = table.to(device)
    new = torch.cat([table[b, p:p + n] for b, (p, n) in enumerate(zip(prefix_lens, extend_lens))])
    q = torch.randn(sum(extend_lens), hq, d, generator=g).to(device=device, dtype=dtype)
    return q, k_pool[new].clone(), v_pool[new].clone(), k_pool, v_pool, extend_indices(prefix_lens, extend_lens, table)


def extend_flops(heads: tuple[int, int, int], prefix_lens: list[int], extend_lens: list[int]) -> int:
    """4 * Hq * D for each (query, visible key): request b's row i sees prefix_b + i + 1 keys."""
    hq, _, d = heads
    return 4 * hq * d * sum(n * p + n * (n + 1) // 2 for p, n in zip(prefix_lens, extend_lens))


def extend_variants(q, k, v, k_pool, v_pool, ix, configs: list[str]) -> dict[str, Callable]:
    """name -> a zero-argument call of each way to run this prefill's attention."""
    from minioverlap.engine.attention import ragged_extend_attention
    from minioverlap.kernels.extend_attention import extend_attention
    from minioverlap.kernels.flash_extend import flash_extend_attention
    args = (q, k, v, k_pool, v_pool, ix.qo_indptr, ix.kv_indptr, ix.kv_indices, ix.max_extend)
    variants = {"reference": lambda: ragged_extend_attention(q, k_pool, v_pool, ix),
                "ch18 kernel": lambda: extend_attention(*args),
                "flash kernel": lambda: flash_extend_attention(*args)}
    for c in configs:
        variants[f"flash {c.replace(',', '-')}"] = lambda c=c: flash_extend_attention(*args, config=tuple(int(x) for x in c.split(",")))
    if len(ix.qo_indptr) == 2 and q.is_cuda:                     # one request: PyTorch's SDPA backends
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        group = q.shape[1] // k_pool.shape[1]
        kf, vf = (pool[ix.kv_indices].repeat_interleave(group, 1).transpose(0, 1)[None] for pool in (k_pool, v_pool))
        qf = q.transpose(0, 1)[None]
        n, s = qf.shape[2], kf.shape[2]
        causal = {"is_causal": True} if n == s else {"attn_mask": causal_lower_right(n, s)}

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qf, kf, vf, **causal)[0].transpose(0, 1)
            return run
        for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
            variants[name] = sdpa(backend)
    return variants


def extend_cases(prompt_lens: list[int], chunk: int, chunk_prefix: int) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (prefix_lens, extend_lens)."""
    cases = {f"prompt {n}": ([0], [n]) for n in prompt_lens}
    cases[f"chunk {chunk} at 0"] = ([0], [chunk])
    cases[f"chunk {chunk} at {chunk_prefix}"] = ([chunk_prefix], [chunk])
    cases["16 prompts of 64"] = ([0] * 16, [64] * 16)
    cases[f"mixed: chunk {chunk} + 8 decode rows at {chunk_prefix}"] = ([chunk_prefix] * 9, [chunk] + [1] * 8)
    return cases


def check_extend(heads: tuple[int, int, int], device: str, dtype: torch.dtype, configs: list[str] = ()) -> dict[str, float]:
    """Both kernels against the reference on a ragged batch (prefixes 0 and not, lengths that are no
    multiple of any block, a decode row) -> variant: max error; raises if one differs."""
    g = torch.Generator().manual_seed(1)
    q, k, v, k_pool, v_pool, ix = extend_inputs(heads, [0, 37, 300, 5, 0], [200, 1, 129, 64, 3], device, dtype, g, 4)
    variants = extend_variants(q, k, v, k_pool, v_pool, ix, list(configs))
    want = variants.pop("reference")()
    return {name: close(fn(), want) for name, fn in variants.items()}


def bench_extend(args: argparse.Namespace) -> dict:
    import triton.testing
    heads = SHAPES["8b"][2:]
    checks = {f"{dtype} d{d}": check_extend((32, 8, d), "cuda", dtype, args.extend_configs if d == 128 and
                                            dtype == torch.bfloat16 else [])        # the sweep is bf16's
              for dtype in (torch.float32, torch.bfloat16) for d in (64, 128, 80)}
    print(checks, flush=True)
    rows, g = [], torch.Generator().manual_seed(0)
    for case, (prefix_lens, extend_lens) in extend_cases(args.prompt_lens, args.chunk, args.chunk_prefix).items():
        inputs = extend_inputs(heads, prefix_lens, extend_lens, "cuda", torch.bfloat16, g)
        variants = extend_variants(*inputs, args.extend_configs)
        try:
            want = variants["reference"]()
        except torch.OutOfMemoryError:                                 # its padded mask, at the longest
            want = variants.pop("reference") and variants["ch18 kernel"]()
        flops = extend_flops(heads, prefix_lens, extend_lens)
        for name, fn in variants.items():
            try:
                err = close(fn(), want)
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            except Exception as e:                                     # a backend that refuses the shape
                print(f"{case}, {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append({"case": case, "batch": len(prefix_lens), "prefix": max(prefix_lens), "new": max(extend_lens),
                         "variant": name, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                         "max_error": round(err, 5)})
            print(rows[-1], flush=True)
        del inputs, variants, want
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "heads": {"q": heads[0], "kv": heads[1], "head_dim": heads[2]}, "checks": checks, "extend": rows}


def report(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console(width=None if sys.stdout.isatty() else 120)
    if "splits" in record:
        counts = sorted({r["splits"] for r in record["splits"]})
        table = Table("shape", "batch", "context", *[f"{n} split{'s' * (n > 1)} us" for n in counts],
                      title=f"{record['device']}, torch {record['torch']}: decode attention, microseconds per call")
        us = {(r["shape"], r["batch"], r["context"], r["splits"]): r["us"] for r in record["splits"]}
        for key in dict.fromkeys((r["shape"], r["batch"], r["context"]) for r in record["splits"]):
            table.add_row(key[0], str(key[1]), str(key[2]), *[fmt_us(us.get((*key, n))) for n in counts])
        console.print(table)
    if "extend" in record:
        table = Table("case", "variant", "ms", "TFLOP/s", "max error",
                      title=f"{record['device']}, torch {record['torch']}: a prefill's attention, 32/8 heads of 128")
        for r in record["extend"]:
            table.add_row(r["case"], r["variant"], f"{r['ms']:.3f}", f"{r['tflops']:.1f}", f"{r['max_error']:.4f}")
        console.print(table)
    if "results" not in record:
        return
    table = Table("shape", "batch", "context", "case", "reference us", "fast us", "speedup", "max error",
                  title=f"{record['device']}, torch {record['torch']}: microseconds per call inside a CUDA graph")
    for r in record["results"]:
        table.add_row(r["shape"], str(r["batch"]), str(r["context"]), r["case"], f"{r['reference_us']:.1f}",
                      f"{r['fast_us']:.1f}", f"{r['reference_us'] / r['fast_us']:.2f}x", f"{r['max_error']:.4f}")
    console.print(table)


def fmt_us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=[s for s in SHAPES if s != "small"], default=["0.6b", "8b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 1024, 4096],
                        help="context lengths for attention (the other cases run at the first)")
    parser.add_argument("--repeats", type=int, default=50, help="copies of each call in its CUDA graph")
    parser.add_argument("--splits", nargs="+", type=int, metavar="N",
                        help="time only the decode attention, split N ways for each N given (powers of two)")
    parser.add_argument("--extend", action="store_true", help="time a prefill's attention instead (extend kernels)")
    parser.add_argument("--prompt-lens", nargs="+", type=int, default=[1024, 4096, 16384, 32768],
                        help="--extend: the one-prompt lengths")
    parser.add_argument("--chunk", type=int, default=2048, help="--extend: a chunk's new tokens")
    parser.add_argument("--chunk-prefix", type=int, default=14336, help="--extend: the chunk's cached prefix")
    parser.add_argument("--extend-configs", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES",
                        help=f"--extend: flash kernel configs to sweep besides its default (e.g. {' '.join(EXTEND_SWEEP[:2])})")
    parser.add_argument("--out", default="bench_kernels.json")
    parser.add_argument("--report", metavar="FILE", help="no run: print the table of a recorded JSON")
    args = parser.parse_args(argv)
    for name in ("batches", "contexts", "prompt_lens"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')} must be integers >= 1, got {getattr(args, name)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be an integer >= 1, got {args.repeats}")
    if args.splits and any(n < 1 or n & (n - 1) for n in args.splits):
        parser.error(f"--splits must be powers of two >= 1, got {args.splits}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        record = json.loads(Path(args.report).read_text())
    elif not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU; --report FILE reads a recorded run")
    else:
        record = bench_extend(args) if args.extend else bench_splits(args) if args.splits else bench(args)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    report(record)


if __name__ == "__main__":
    main()
