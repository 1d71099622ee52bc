"""The pictures of chapters 17, 18 and 20, drawn from the engine's own state, so that they cannot disagree
with the code: each figure runs the tiny model on the CPU, reads the structure the chapter explains, writes
what it read as chapters/figures/NAME.json and draws chapters/figures/NAME.png from that JSON.

    python tools/draw_figures.py                      # every figure, into chapters/figures/
    python tools/draw_figures.py --out DIR            # elsewhere (tests/tools/test_figures.py: a temp dir)
    python tools/draw_figures.py --only 18-ragged-batch

    17-radix-tree     two prompts that share a prefix ending inside a node's key: the first one's node is
                      split when the second matches; the second, running, locks its path; every page of
                      the pool is free, the tree's, or the running request's own (RadixCache, ModelRunner)
    18-ragged-batch   a mixed step of chapter 18: a new prompt, a chunk after a cached prefix and three
                      decode rows, as extend attention reads them: qo_indptr, kv_indptr and the KV index
                      list (PagedAttention.extend, attention.extend_indices)
    20-dp-exchanges   one iteration of DP attention over two CPU ranks (gloo), one request: the inbox
                      broadcast, the [busy, load, handles first] and token-count all-gathers, and the
                      replies gathered on rank 0, read from rank 0's collectives and both ranks' traces

Deterministic: greedy tokens of the shipped model on one CPU thread, the pool's pages handed out lowest
first, and no time in the data (the traces give the order of events, never their times). The JSON is the
record the chapters quote (`<!-- fig: 17-radix-tree.json ... -->`) and the test compares with the engine;
the PNG is drawn from it alone (`draw(name, data, path)`), with no date in its metadata (only matplotlib's
version, so that the test compares the committed PNG byte for byte where the same matplotlib runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "chapters" / "figures"
NAMES = ("17-radix-tree", "18-ragged-batch", "20-dp-exchanges")


# ---------------------------------------------------------------- where the engine keeps things

def find_tree(llm):
    """The engine's RadixCache. Today the runner holds it (`llm.runner.tree`); if a cache manager comes to
    hold it (`llm.runner.cache.tree`, `llm.cache.tree`), this is the one place to adjust."""
    from minioverlap.cache.radix import RadixCache
    runner = llm.runner
    for owner in (runner, getattr(runner, "cache", None), getattr(llm, "cache", None)):
        tree = getattr(owner, "tree", None)
        if isinstance(tree, RadixCache):
            return tree
    raise LookupError("no RadixCache found at llm.runner.tree, llm.runner.cache.tree or llm.cache.tree: "
                      "adjust find_tree in tools/draw_figures.py")


def find_allocator(llm):
    """The engine's PageAllocator (the pool's free list), found beside the tree (find_tree)."""
    tree = find_tree(llm)
    return tree.allocator


# ---------------------------------------------------------------- 17: the radix tree

RADIX_PROMPTS = ("def area(r):\n    return 3.14 * r * r", "def area(r):\n    return math.pi * r ** 2")
RADIX_OPTIONS = dict(model="tiny", page_size=4, num_pages=24, overlap=False)
RADIX_FIRST_TOKENS = 4        # the first request runs to the end: its prompt and output go into the tree
RADIX_SECOND_REPLIES = 3      # the second is looked at while it runs, after this many replies


def tree_snapshot(llm, requests: list | None = None) -> dict:
    """The tree's nodes (depth first, children by their first page's tokens), each with its key as tokens
    and text, its pages and its lock count; the pool's owners; each running request's path and pages."""
    tree, allocator = find_tree(llm), find_allocator(llm)
    nodes, index = [], {}

    def visit(node, parent: int | None, depth: int) -> None:
        index[id(node)] = len(nodes)
        nodes.append(dict(id=len(nodes), parent=parent, depth=depth, tokens=len(node.key),
                          text=llm.decode(list(node.key)) if node.key else "", pages=list(node.pages),
                          lock=node.lock if node is not tree.root else None))
        for key in sorted(node.children):
            visit(node.children[key], index[id(node)], depth + 1)
    visit(tree.root, None, 0)
    running = []
    for req in requests or []:
        cached = req.cached_len // allocator.page_size
        path, node = [], req.last_node
        while node is not tree.root:
            path.insert(0, index[id(node)])
            node = node.parent
        running.append(dict(uid=req.uid, seq_len=req.seq_len, cached_len=req.cached_len, path=path,
                            locks=[nodes[i]["lock"] for i in path], tree_pages=req.pages[:cached],
                            own_pages=req.pages[cached:]))
    owner = {p: "free" for p in allocator.free_pages}
    owner.update((p, "tree") for p in tree.pages())
    for r in running:
        owner.update((p, f"request {r['uid']}") for p in r["own_pages"])
    return dict(nodes=nodes, running=running, cached_pages=tree.cached_pages, evictable_pages=tree.evictable_pages,
                free=sorted(allocator.free_pages), num_free=allocator.num_free,
                pool=[dict(page=p, owner=owner.get(p, "?")) for p in range(1, allocator.num_pages)])


def radix_data() -> dict:
    """Run the two prompts of RADIX_PROMPTS one after the other; the tree after the first, and while the
    second runs (its match split the first one's node; its handled prefill added its own branch)."""
    from minioverlap import LLM, SamplingParams
    llm = LLM(**RADIX_OPTIONS)
    first, second = RADIX_PROMPTS
    llm.generate(first, SamplingParams(max_tokens=RADIX_FIRST_TOKENS))
    before = tree_snapshot(llm)
    stream = llm.stream(second, SamplingParams(max_tokens=RADIX_SECOND_REPLIES + 8))
    for _ in range(RADIX_SECOND_REPLIES):
        next(stream)
    running = [r for r in llm.scheduler.running]
    problems = llm.runner.cache.integrity_problems(running)
    after = tree_snapshot(llm, running)
    stream.close()
    llm.check_integrity()
    a, b = (llm.encode(p) for p in RADIX_PROMPTS)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return dict(options={k: v for k, v in RADIX_OPTIONS.items()}, prompts=list(RADIX_PROMPTS),
                prompt_tokens=[len(a), len(b)], shared_tokens=shared, first_max_tokens=RADIX_FIRST_TOKENS,
                second_replies=RADIX_SECOND_REPLIES, integrity_problems=problems, before=before, after=after)


# ---------------------------------------------------------------- 18: the ragged layout of a mixed step

RAGGED_OPTIONS = dict(model="tiny", page_size=4, overlap=False, chunked_prefill_size=16, mixed_chunk=True,
                      max_running=8)
RAGGED_CACHED = list(range(300, 313))                   # prompt cached first: its first 12 tokens stay
RAGGED_LONG = RAGGED_CACHED + list(range(500, 511))     # 24 tokens: 12 from the cache, then chunks
RAGGED_NEW = list(range(700, 706))                      # 6 tokens seen nowhere: prefilled whole
RAGGED_DECODE = [list(range(900 + 20 * i, 903 + 20 * i + i)) for i in range(3)]   # 3, 4, 5 tokens: one step


def ragged_data() -> dict:
    """Three requests decoding; a new prompt and a long one (whose first 12 tokens are cached) arrive.
    The step that takes both is a mixed step: the new prompt whole, the long one's first chunk after its
    cached prefix (the budget's rest), the three decode rows. Its layout is read from the step's own
    attention context (PagedAttention.extend, built by attention.extend_indices from its page table)."""
    from minioverlap import LLM, SamplingParams
    from minioverlap.engine.forward_batch import ForwardMode
    llm = LLM(**RAGGED_OPTIONS)
    llm.generate(RAGGED_CACHED, SamplingParams(max_tokens=1))
    runner, seen = llm.runner, []
    attention = runner.attention

    def spy(batch):
        ctx = attention(batch)
        if batch.mode is ForwardMode.EXTEND:
            seen.append((batch, ctx, [dict(uid=r.uid, cached_tokens=r.cached_tokens, prompt=len(r.prompt_ids),
                                           pages=list(r.pages)) for r in batch.reqs]))
        return ctx
    runner.attention = spy
    stream = llm.stream(RAGGED_DECODE, SamplingParams(max_tokens=12, ignore_eos=True))
    next(stream)
    uids = [llm.add_request(RAGGED_NEW, SamplingParams(max_tokens=4, ignore_eos=True)),
            llm.add_request(RAGGED_LONG, SamplingParams(max_tokens=4, ignore_eos=True))]
    for _ in stream:
        pass
    runner.attention = attention
    llm.check_integrity()
    batch, ctx, reqs = next(s for s in seen if {r["uid"] for r in s[2]} >= set(uids))
    ix = ctx.extend
    kinds = {uids[0]: "new prompt", uids[1]: "chunk after a cached prefix"}
    rows = []
    for i, (r, prefix, n) in enumerate(zip(reqs, batch.prefix_lens, batch.extend_lens)):
        rows.append(dict(b=i, uid=r["uid"], kind=kinds.get(r["uid"], "decode row"), prompt=r["prompt"],
                         cached=r["cached_tokens"], prefix=prefix, extend=n, pages=r["pages"]))
    return dict(options=dict(RAGGED_OPTIONS), rows=rows, chunked=[bool(c) for c in batch.chunks()],
                qo_indptr=ix.qo_indptr.tolist(), kv_indptr=ix.kv_indptr.tolist(),
                kv_indices=ix.kv_indices.tolist(), kv_batch=ix.kv_batch.tolist(), kv_pos=ix.kv_pos.tolist(),
                max_extend=ix.max_extend, max_kv=ix.max_kv, out_cache_loc=batch.out_cache_loc.tolist(),
                tokens=sum(batch.extend_lens), budget=RAGGED_OPTIONS["chunked_prefill_size"])


# ---------------------------------------------------------------- 20: DP attention's exchanges

DP_PROMPT = "def fibonacci(n):"
DP_OPTIONS = dict(model="tiny", tp_size=2, dp_attention=True, overlap=False)
DP_ITERATION = 1


def dp_data() -> dict:
    """One request over two DP-attention ranks, normal loop. Rank 0's collectives return every rank's part,
    so rank 0 records all three exchanges of each iteration: the inbox it broadcasts (`share`), every rank's
    [busy, load, handles first] (busy_anywhere), every rank's token count (agree), every rank's replies
    (gather_replies). Both ranks' traces give each lane's events in order."""
    from minioverlap import LLM, SamplingParams
    llm = LLM(**DP_OPTIONS)
    try:
        sched, group, log = llm.scheduler, llm.scheduler.group, []
        share, gather_ints, gather_object = sched.share, group.all_gather_ints, group.all_gather_object
        inside, fingerprints = [], []          # inside: the exchange whose own collectives run now

        def shared(items):
            inside.append("inbox")              # its fingerprint check all-gathers one int a rank (ranks.parted)
            try:
                out = share(items)
            finally:
                inside.pop()
            log.append(dict(exchange="inbox", values=[[kind, getattr(item, "uid", item)] for kind, item in out],
                            fingerprints_equal=len({f for [f] in fingerprints.pop()}) == 1))
            return out

        def ints(values):
            out = gather_ints(values)
            if inside == ["inbox"]:
                fingerprints.append(out)
            elif not inside:
                log.append(dict(exchange="busy" if len(values) == 3 else "agree", values=out))
            return out

        def objects(obj):
            inside.append("replies")            # the pickles' lengths are all-gathered first
            try:
                out = gather_object(obj)
            finally:
                inside.pop()
            log.append(dict(exchange="replies", values=[[dict(uid=reply.uid, tokens=list(reply.token_ids),
                                                              finished=reply.finished) for reply in part]
                                                        for part in out]))
            return out
        sched.share, group.all_gather_ints, group.all_gather_object = shared, ints, objects
        out = llm.generate(DP_PROMPT, SamplingParams(max_tokens=3))[0]
        sched.share, group.all_gather_ints, group.all_gather_object = share, gather_ints, gather_object
        traces = llm.rank_traces()
    finally:
        llm.shutdown()
    # the log, cut into iterations: each opens with the inbox
    iterations = []
    for entry in log:
        if entry["exchange"] == "inbox":
            iterations.append([])
        iterations[-1].append(entry)
    lanes = []
    for rank, trace in enumerate(traces):
        start = next(i for i, e in enumerate(trace) if e.kind == "share" and e.step == DP_ITERATION)
        end = next((i for i, e in enumerate(trace) if i > start and e.kind == "share"), len(trace))
        lanes.append([dict(kind=e.kind, step=e.step, uids=list(e.uids)) for e in trace[start:end]])
    return dict(options=dict(DP_OPTIONS), prompt=DP_PROMPT, prompt_tokens=len(llm.encode(DP_PROMPT)),
                tokens=list(out.token_ids), iteration=DP_ITERATION, exchanges=iterations[DP_ITERATION - 1],
                lanes=lanes, iterations=len(iterations))


DATA = {"17-radix-tree": radix_data, "18-ragged-batch": ragged_data, "20-dp-exchanges": dp_data}


# ---------------------------------------------------------------- main

def write(name: str, out: Path) -> tuple[Path, Path]:
    """Compute figure `name` from the engine, write its JSON, draw its PNG from that JSON."""
    data = DATA[name]()
    out.mkdir(parents=True, exist_ok=True)
    record = out / f"{name}.json"
    record.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    png = out / f"{name}.png"
    draw(name, json.loads(record.read_text()), png)
    return record, png


# ---------------------------------------------------------------- drawing (from the JSON alone)

COLORS = dict(tree="#9ecae1", locked="#fdae6b", own="#fd8d3c", free="#e0e0e0", new="#74c476", prefix="#c7e9c0",
              cached="#9ecae1", edge="#444444", lock_edge="#d94801", rank0="#deebf7", rank1="#fee6ce",
              exchange="#fff7bc")


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.family": "DejaVu Sans", "font.size": 10, "svg.hashsalt": "minioverlap"})
    return plt


def save(fig, path: Path) -> None:
    """A PNG with no date in it (matplotlib writes only its version, tEXt "Software"): the same data drawn
    by the same matplotlib gives the same bytes, and the test knows which matplotlib drew the committed one."""
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)


def shown(text: str) -> str:
    """A node's key as the figure prints it: newlines as \\n, quoted so that spaces show."""
    return '"' + text.replace("\n", "\\n") + '"'


def tree_layout(nodes: list[dict]) -> dict[int, tuple[float, float]]:
    """(x, y) of each node: x its depth, y the mean of its leaves' rows (leaves top to bottom, depth first)."""
    children = {n["id"]: [c["id"] for c in nodes if c["parent"] == n["id"]] for n in nodes}
    place, row = {}, [0]

    def visit(i: int) -> float:
        if not children[i]:
            y = row[0]
            row[0] += 1
        else:
            ys = [visit(c) for c in children[i]]
            y = sum(ys) / len(ys)
        place[i] = (nodes[i]["depth"], y)
        return y
    visit(0)
    return place


def pages_label(pages: list[int]) -> str:
    return ("page " if len(pages) == 1 else "pages ") + ", ".join(map(str, pages))


def draw_tree(ax, snap: dict, title: str, split: tuple[int, int, list[int]] | None = None) -> None:
    """One snapshot's tree, root at the left; a running request's path drawn thick, with its lock counts.
    split: (head, tail, pages): the nodes a split made of one node's pages."""
    nodes, place = snap["nodes"], tree_layout(snap["nodes"])
    on_path = {i for r in snap["running"] for i in r["path"]}
    dx, dy = 3.3, 1.3
    xy = {i: (x * dx, -y * dy) for i, (x, y) in place.items()}
    boxes = {}
    for n in nodes:
        x, y = xy[n["id"]]
        if n["id"] == 0:
            boxes[0] = ax.text(x, y, "root", ha="center", va="center", fontsize=10,
                               bbox=dict(boxstyle="circle,pad=0.3", fc="white", ec=COLORS["edge"]))
            continue
        locked = n["lock"] > 0
        label = f"{shown(n['text'])}\n{n['tokens']} tokens, {pages_label(n['pages'])}\nlock {n['lock']}"
        boxes[n["id"]] = ax.text(x, y, label, ha="center", va="center", fontsize=8.5, linespacing=1.35,
                                 bbox=dict(boxstyle="round,pad=0.4", fc=COLORS["locked"] if locked else COLORS["tree"],
                                           ec=COLORS["lock_edge"] if locked else COLORS["edge"], lw=2 if locked else 1))
    for n in nodes[1:]:
        hot = n["id"] in on_path
        ax.annotate("", (0, 0.5), xycoords=boxes[n["id"]], xytext=(1, 0.5), textcoords=boxes[n["parent"]],
                    arrowprops=dict(arrowstyle="-|>", color=COLORS["lock_edge"] if hot else COLORS["edge"],
                                    lw=2.6 if hot else 1.2, shrinkA=4, shrinkB=4, mutation_scale=14))
    if split:
        head, tail, pages = split
        (x0, y0), (x1, y1) = xy[head], xy[tail]
        ax.text((x0 + x1) / 2 + 0.15, max(y0, y1) + 0.62, f"the split: the node of {pages_label(pages)}\n"
                f"cut after {len(nodes[head]['pages'])} pages, where request 1's match ends",
                ha="center", va="bottom", fontsize=8, style="italic", color="#7a0177")
    ys = [y for _, y in xy.values()]
    ax.set_xlim(-0.8, max(x for x, _ in xy.values()) + 1.6)
    ax.set_ylim(min(ys) - 0.7, max(ys) + 1.5)
    ax.set_title(title, fontsize=10.5, loc="left")
    ax.axis("off")


def draw_radix(data: dict, path: Path) -> None:
    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle
    before, after = data["before"], data["after"]
    [req] = after["running"]
    # the split: two nodes of `after`, parent and child, that share one node of `before`'s pages
    split = None
    for n in after["nodes"][1:]:
        for m in before["nodes"][1:]:
            parent = after["nodes"][n["parent"]]
            if set(n["pages"]) < set(m["pages"]) and set(parent["pages"]) < set(m["pages"]):
                split = (parent["id"], n["id"], m["pages"])
    fig = plt.figure(figsize=(13.6, 6.6))
    grid = fig.add_gridspec(2, 2, height_ratios=[3.0, 1.25], width_ratios=[1, 1.45], hspace=0.12, wspace=0.04,
                            left=0.02, right=0.99, top=0.84, bottom=0.02)
    first, second = (shown(p) for p in data["prompts"])
    fig.suptitle("The radix tree (page size 4): a split, a locked path, and the three owners of a page",
                 fontsize=13, x=0.02, y=0.985, ha="left")
    fig.text(0.02, 0.925, f"request 0: {first} ({data['prompt_tokens'][0]} tokens)\n"
             f"request 1: {second} ({data['prompt_tokens'][1]} tokens); the two share their first "
             f"{data['shared_tokens']} tokens", fontsize=9.5, ha="left", va="center", color="#333333",
             family="DejaVu Sans Mono")
    draw_tree(fig.add_subplot(grid[0, 0]), before, "1. request 0 has finished: the tree keeps its prompt\n"
              "and output (its prefill's node, then its release's)")
    locked_path = " -> ".join(pages_label(after["nodes"][i]["pages"]) for i in req["path"])
    draw_tree(fig.add_subplot(grid[0, 1]), after, f"2. request 1 runs: its match split the first node, its handled "
              f"prefill added\nits branch, and it locks its path: root -> {locked_path}", split)
    ax = fig.add_subplot(grid[1, :])
    colors = {"free": COLORS["free"], "tree": COLORS["tree"], f"request {req['uid']}": COLORS["own"]}
    pool = after["pool"]
    locked_pages = {p for i in req["path"] for p in after["nodes"][i]["pages"]}
    for k, cell in enumerate(pool):
        locked = cell["page"] in locked_pages
        ax.add_patch(Rectangle((k, 1.3), 0.92, 0.9, fc=colors[cell["owner"]],
                               ec=COLORS["lock_edge"] if locked else "#666666", lw=2 if locked else 0.8))
        ax.text(k + 0.46, 1.75, str(cell["page"]), ha="center", va="center", fontsize=9)
    ax.text(-0.3, 1.75, "the pool's pages", ha="right", va="center", fontsize=9.5)
    # the running request's pages: its first cached_len // page_size are the tree's, the rest its own
    row = req["tree_pages"] + req["own_pages"]
    for k, page in enumerate(row):
        own = k >= len(req["tree_pages"])
        ax.add_patch(Rectangle((k, 0), 0.92, 0.9, fc=COLORS["own"] if own else COLORS["tree"],
                               ec="#666666" if own else COLORS["lock_edge"], lw=0.8 if own else 2))
        ax.text(k + 0.46, 0.45, str(page), ha="center", va="center", fontsize=9)
    ax.text(-0.3, 0.45, f"request {req['uid']}'s pages", ha="right", va="center", fontsize=9.5)
    n = len(req["tree_pages"])
    ax.plot([n - 0.04] * 2, [-0.15, 1.05], color="black", lw=1.6)
    ax.text(len(row) + 0.3, 0.45, f"cached_len {req['cached_len']}: pages[:{n}] are the tree's (shared, locked), "
            f"pages[{n}:] its own; seq_len {req['seq_len']}", ha="left", va="center", fontsize=9)
    counts = {o: sum(c["owner"] == o for c in pool) for o in colors}
    mine = f"request {req['uid']}"
    ax.legend(handles=[Patch(fc=colors["free"], ec="#666666", label=f"free list ({counts['free']})"),
                       Patch(fc=COLORS["tree"], ec="#666666", label=f"held by the tree ({counts['tree']})"),
                       Patch(fc=COLORS["own"], ec="#666666", label=f"{mine}'s own ({counts[mine]})"),
                       Patch(fc="white", ec=COLORS["lock_edge"], lw=2, label="on the locked path")],
              loc="upper right", ncol=4, fontsize=9, frameon=False, bbox_to_anchor=(1.0, 1.22))
    ax.set_xlim(-6.2, len(pool) + 0.2)
    ax.set_ylim(-0.3, 2.9)
    ax.axis("off")
    save(fig, path)


def draw_ragged(data: dict, path: Path) -> None:
    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle
    rows, qo, kv, idx = data["rows"], data["qo_indptr"], data["kv_indptr"], data["kv_indices"]
    palette = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e"]
    light = ["#b3e2cd", "#fdcdac", "#cbd5e8", "#f4cae4", "#e6f5c9"]
    fig = plt.figure(figsize=(14.5, 8.2))
    fig.suptitle(f"A mixed step's ragged layout, as extend attention reads it ({len(rows)} requests, "
                 f"{data['tokens']} new tokens, budget {data['budget']}, page size {data['options']['page_size']})",
                 fontsize=13, x=0.01, ha="left")
    ax = fig.add_axes((0.01, 0.02, 0.98, 0.9))
    cell = 0.62
    # per request: its KV entries in position order (slot numbers), prefix light, new tokens strong
    top = 0.0
    ax.text(0, top + 0.55, "each request's KV slots, position by position (kv_indices[kv_indptr[b] : "
            "kv_indptr[b+1]]); its new tokens, whose queries run, are the last extend_len of them",
            fontsize=9.5, ha="left", va="bottom")
    x0 = 12.5 * cell
    for r in rows:
        b = r["b"]
        y = top - (b + 1) * 0.95
        desc = {"new prompt": "a new prompt, whole", "decode row": "a decode row",
                "chunk after a cached prefix": f"a chunk, after {r['cached']} cached tokens"}[r["kind"]]
        ax.text(0, y + 0.3, f"b={b}  request {r['uid']}: {desc}", fontsize=9.5, ha="left", va="center")
        ax.text(0, y + 0.3 - 0.38, f"prefix {r['prefix']}, new {r['extend']}" + (", the prompt goes on"
                if data["chunked"][b] else ""), fontsize=8.5, ha="left", va="center", color="#555555")
        for pos in range(r["prefix"] + r["extend"]):
            new = pos >= r["prefix"]
            cached = pos < r["cached"]
            ax.add_patch(Rectangle((x0 + pos * cell, y), cell * 0.94, 0.62, fc=palette[b] if new else light[b],
                                   ec="#333333", lw=0.6, hatch="///" if cached else None))
            ax.text(x0 + pos * cell + cell * 0.47, y + 0.31, str(idx[kv[b] + pos]), ha="center", va="center",
                    fontsize=8, color="white" if new else "black",
                    bbox=dict(boxstyle="square,pad=0.05", fc=light[b], ec="none") if cached else None)
        ax.text(x0 + (r["prefix"] + r["extend"]) * cell + 0.2, y + 0.31,
                f"kv_indices[{kv[b]}:{kv[b + 1]}], q[{qo[b]}:{qo[b + 1]}]", fontsize=8.5, va="center")
    ax.text(x0, top + 0.2, "position 0", fontsize=8, color="#555555")
    # the flat arrays
    y = top - (len(rows) + 1) * 0.95 - 0.5
    flat = 0.42

    def array(y: float, name: str, values: list[int], owners: list[int], strong: list[bool], ptr: list[int],
              ptr_name: str, hatched: list[bool]) -> None:
        ax.text(0, y + 0.3, name, fontsize=9.5, ha="left", va="center", family="DejaVu Sans Mono")
        for k, (v, b, s) in enumerate(zip(values, owners, strong)):
            ax.add_patch(Rectangle((x0 + k * flat, y), flat * 0.94, 0.6, fc=palette[b] if s else light[b],
                                   ec="#333333", lw=0.5, hatch="///" if hatched[k] else None))
            ax.text(x0 + k * flat + flat * 0.47, y + 0.3, str(v), ha="center", va="center", fontsize=7,
                    color="white" if s else "black",
                    bbox=dict(boxstyle="square,pad=0.05", fc=light[b], ec="none") if hatched[k] else None)
        for b, p in enumerate(ptr):
            ax.plot([x0 + p * flat - flat * 0.03] * 2, [y - 0.25, y + 0.85], color="black", lw=1.4)
            ax.text(x0 + p * flat, y - 0.3, str(p), ha="center", va="top", fontsize=8.5)
        ax.text(0, y - 0.4, f"{ptr_name} = [{', '.join(map(str, ptr))}]", fontsize=9.5, ha="left", va="center",
                family="DejaVu Sans Mono")

    q_owner = [b for b in range(len(rows)) for _ in range(qo[b + 1] - qo[b])]
    array(y, "q rows (new tokens)", list(range(qo[-1])), q_owner, [True] * qo[-1], qo, "qo_indptr", [False] * qo[-1])
    y -= 1.75
    kv_owner, kv_new = data["kv_batch"], [p >= rows[b]["prefix"] for b, p in zip(data["kv_batch"], data["kv_pos"])]
    kv_cached = [p < rows[b]["cached"] for b, p in zip(data["kv_batch"], data["kv_pos"])]
    array(y, "kv_indices (slots)", idx, kv_owner, kv_new, kv, "kv_indptr", kv_cached)
    ax.legend(handles=[Patch(fc=palette[1], ec="#333333", label="new tokens: their K and V stored by this step "
                             "(out_cache_loc), their queries run"),
                       Patch(fc=light[1], ec="#333333", label="prefix: K and V in the pool from earlier steps"),
                       Patch(fc=light[1], ec="#333333", hatch="///", label="prefix from the tree (a cache hit)")],
              loc="lower left", bbox_to_anchor=(0.0, -0.02), ncol=3, fontsize=9, frameon=False)
    ax.set_xlim(-0.1, x0 + max(len(idx) * flat, data["max_kv"] * cell + 4.2) + 0.2)
    ax.set_ylim(y - 1.6, top + 1.0)
    ax.axis("off")
    save(fig, path)


def draw_dp(data: dict, path: Path) -> None:
    plt = pyplot()
    from matplotlib.patches import FancyBboxPatch, Rectangle
    ex = {e["exchange"]: e for e in data["exchanges"]}
    lanes = data["lanes"]
    # columns: an exchange is a band across both lanes; a rank's own work a box on its lane
    columns = ["share", "busy", "schedule", "agree", "launch", "wait", "process", "reply", "replies"]
    col = {k: i for i, k in enumerate(columns)}
    col["idle"] = col["launch"]
    width, lane_y = 1.55, {0: 1.6, 1: 0.0}
    fig, ax = plt.subplots(figsize=(15.5, 5.6))
    fig.subplots_adjust(left=0.01, right=0.99, top=0.9, bottom=0.01)
    loop = "overlap" if data["options"]["overlap"] else "normal"
    fig.suptitle(f"DP attention over {len(lanes)} CPU ranks: the exchanges of iteration {data['iteration']} "
                 f"({loop} loop, one request: {shown(data['prompt'])}, {data['prompt_tokens']} tokens)",
                 fontsize=13, x=0.01, ha="left")
    for rank, y in lane_y.items():
        ax.add_patch(Rectangle((-1.5, y - 0.5), len(columns) * width + 1.4, 1.0,
                               fc=COLORS[f"rank{rank}"], ec="none", zorder=0))
        ax.text(-1.4, y, f"rank {rank}", fontsize=11, va="center", ha="left", weight="bold")
    loads = [v[1] for v in ex["busy"]["values"]]
    counts = [n for [n] in ex["agree"]["values"]]
    inbox = ", ".join(f"{kind} request {uid}" for kind, uid in ex["inbox"]["values"]) or "nothing"
    replies = ["; ".join(f"request {r['uid']}, tokens {r['tokens']}" for r in part) or "none" for part in ex["replies"]["values"]]
    bands = {
        "share": ("1a. inbox", f"rank 0's inbox to\nevery rank (broadcast):\n{inbox}\nfingerprints "
                  f"{'equal' if ex['inbox']['fingerprints_equal'] else 'differ'}"),
        "busy": ("1b. busy, load", "all-gather of\n[busy, load, first]:\n" +
                 "\n".join(f"rank {k}: {v}" for k, v in enumerate(ex["busy"]["values"])) +
                 f"\nnew request -> rank {loads.index(min(loads))}"),
        "agree": ("2. agree", "all-gather of token\ncounts: " + str(counts) + f"\nmax {max(counts)}: every rank"
                  "\nruns a step, MLP rows\npadded to it"),
        "replies": ("3. replies", "all-gather of replies,\nkept on rank 0:\n" +
                    "\n".join(f"rank {k}: {v}" for k, v in enumerate(replies))),
    }
    for kind, (head, text) in bands.items():
        x = col[kind] * width
        ax.add_patch(Rectangle((x - width * 0.47, -0.62), width * 0.94, 2.84, fc=COLORS["exchange"],
                               ec="#b8a000", lw=1.2, zorder=1))
        ax.text(x, 2.35, head, ha="center", va="bottom", fontsize=10, weight="bold")
        ax.text(x, -0.72, text, ha="center", va="top", fontsize=8.3, linespacing=1.3)
        ax.annotate("", (x, lane_y[1] + 0.28), (x, lane_y[0] - 0.28),
                    arrowprops=dict(arrowstyle="-|>" if kind == "share" else "<|-" if kind == "replies" else "<|-|>",
                                    lw=1.6, color="#7a5c00"), zorder=3)
    names = {"share": "share", "agree": "agree", "schedule": "schedule", "launch": "launch", "idle": "idle",
             "wait": "wait", "process": "process", "reply": "reply"}
    notes = {"schedule": "its batch", "launch": "the step", "idle": "the empty batch", "process": "its token",
             "reply": "its own replies", "wait": "for the step"}
    for rank, events in enumerate(lanes):
        for e in events:
            x, y = col[e["kind"]] * width, lane_y[rank]
            exchange = e["kind"] in ("share", "agree")
            label = names[e["kind"]] + f" {e['step']}"
            if e["kind"] == "agree":
                label += f"\n{e['uids']}"
            elif e["kind"] in notes:
                label += f"\n({notes[e['kind']]})"
            ax.add_patch(FancyBboxPatch((x - 0.62, y - 0.3), 1.24, 0.6, boxstyle="round,pad=0.03",
                                        fc="white" if exchange else "#f7f7f7",
                                        ec="#e6550d" if e["kind"] == "idle" else "#333333",
                                        lw=2 if e["kind"] == "idle" else 1, zorder=4))
            ax.text(x, y, label, ha="center", va="center", fontsize=8.5, zorder=5,
                    color="#e6550d" if e["kind"] == "idle" else "black")
    # a rank whose count is 0 scheduled nothing: its trace has no schedule event
    for rank, events in enumerate(lanes):
        if counts[rank] == 0 and not any(e["kind"] == "schedule" for e in events):
            x, y = col["schedule"] * width, lane_y[rank]
            ax.add_patch(FancyBboxPatch((x - 0.62, y - 0.3), 1.24, 0.6, boxstyle="round,pad=0.03", fc="none",
                                        ec="#999999", ls="--", lw=1, zorder=4))
            ax.text(x, y, "no batch\n(nothing to run)", ha="center", va="center", fontsize=8.5, color="#777777",
                    style="italic", zorder=5)
    ax.annotate("", (len(columns) * width - 0.6, 2.85), (-0.7, 2.85),
                arrowprops=dict(arrowstyle="-|>", color="#888888", lw=1))
    ax.text(-0.7, 2.92, "each rank's events in the order its trace records them", ha="left", va="bottom",
            fontsize=8.5, color="#666666")
    ax.set_xlim(-1.6, len(columns) * width - 0.1)
    ax.set_ylim(-2.15, 3.25)
    ax.axis("off")
    save(fig, path)


DRAW = {"17-radix-tree": draw_radix, "18-ragged-batch": draw_ragged, "20-dp-exchanges": draw_dp}


def draw(name: str, data: dict, path: Path) -> None:
    """Draw figure `name` from its JSON record alone."""
    DRAW[name](data, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(FIGURES), help="the folder for NAME.json and NAME.png")
    parser.add_argument("--only", nargs="+", choices=NAMES, default=list(NAMES))
    parser.add_argument("--data-only", action="store_true", help="write the JSON, draw nothing")
    parser.add_argument("--from-json", action="store_true", help="draw the PNG from the JSON in --out, run nothing")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    for name in args.only:
        if args.from_json:
            record = Path(args.out) / f"{name}.json"
            draw(name, json.loads(record.read_text()), record.with_suffix(".png"))
            print(f"drew {record.with_suffix('.png')}")
            continue
        if args.data_only:
            data = DATA[name]()
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{name}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
            print(f"wrote {Path(args.out) / f'{name}.json'}")
            continue
        record, png = write(name, Path(args.out))
        print(f"wrote {record} and {png}")
    return 0


if __name__ == "__main__":      # the ranks of 20-dp-exchanges are spawned processes that import this file
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
