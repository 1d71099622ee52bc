"""tools/draw_figures.py: the pictures of chapters 17, 18 and 20 are drawn from the engine's own state.

One run of the script into a temporary folder (the tiny model on the CPU, two gloo ranks for chapter 20)
gives every figure's JSON and PNG. The JSON must equal the record in chapters/figures/ (so the picture
and the numbers the chapters quote are what the engine computes now), hold together on its own (the
tree's account, the index pointers against the pages, the ranks' exchanges), and each chapter must show
its PNG. The committed PNG must be what its JSON draws: byte for byte where this matplotlib drew it (the
PNG names its version), its size elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "draw_figures.py"
FIGURES = ROOT / "chapters" / "figures"
CHAPTERS = {"17-radix-tree": "17-prefix-cache.md", "18-ragged-batch": "18-chunked-prefill.md",
            "20-dp-exchanges": "20-parallel.md"}


def load_script():
    spec = importlib.util.spec_from_file_location("draw_figures_tool", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def drawn(tmp_path_factory) -> Path:
    """Every figure, computed from the engine now and drawn, in a folder of its own."""
    out = tmp_path_factory.mktemp("figures")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)    # the parent's kept
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=out, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}{s}" for n in CHAPTERS for s in (".json", ".png"))
    return out


def png_size_and_text(path: Path) -> tuple[tuple[int, int], dict[str, str]]:
    """A PNG's width and height, and its tEXt chunks."""
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), path
    size, text, at = None, {}, 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            text[key.decode("latin-1")] = value.decode("latin-1")
        at += 12 + length
    return size, text


@pytest.mark.parametrize("name", sorted(CHAPTERS))
def test_the_record_is_what_the_engine_computes_now(drawn, name):
    """Run again, the engine gives the committed record exactly: the picture shows today's code."""
    now = json.loads((drawn / f"{name}.json").read_text())
    assert now == json.loads((FIGURES / f"{name}.json").read_text()), (
        f"chapters/figures/{name}.json is stale: python tools/draw_figures.py --only {name}")


@pytest.mark.parametrize("name", sorted(CHAPTERS))
def test_the_committed_png_is_what_its_record_draws(drawn, name, tmp_path):
    import matplotlib
    committed, fresh = FIGURES / f"{name}.png", drawn / f"{name}.png"
    load_script().draw(name, json.loads((FIGURES / f"{name}.json").read_text()), tmp_path / "again.png")
    (size, text), (fresh_size, _) = png_size_and_text(committed), png_size_and_text(fresh)
    assert size == fresh_size and min(size) > 300
    assert (tmp_path / "again.png").read_bytes() == fresh.read_bytes()          # drawn from the JSON alone
    if f"version{matplotlib.__version__}," in text.get("Software", ""):
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"chapters/figures/{name}.png is stale: python tools/draw_figures.py --only {name}")


@pytest.mark.parametrize("name", sorted(CHAPTERS))
def test_each_chapter_shows_its_figure(name):
    text = (ROOT / "chapters" / CHAPTERS[name]).read_text()
    assert f"](figures/{name}.png)" in text


def test_the_tree_splits_locks_and_owns_every_page_once(drawn):
    data = json.loads((drawn / "17-radix-tree.json").read_text())
    before, after = data["before"], data["after"]
    assert data["integrity_problems"] == []
    [req] = after["running"]
    nodes = after["nodes"]
    # the split: the first request's first node is now two, the head ending where the match ended
    [first] = [n for n in before["nodes"] if n["parent"] == 0]
    head = nodes[req["path"][0]]
    tail = [n for n in nodes if n["parent"] == head["id"] and set(n["pages"]) < set(first["pages"])]
    assert head["pages"] + tail[0]["pages"] == first["pages"] and head["tokens"] == data["shared_tokens"]
    # the lock path: every node from the root to the request's node counts it; the others 0
    assert req["locks"] == [1] * len(req["path"])
    assert all(n["lock"] == 0 for n in nodes[1:] if n["id"] not in req["path"])
    assert req["tree_pages"] == [p for i in req["path"] for p in nodes[i]["pages"]]
    assert req["cached_len"] == len(req["tree_pages"]) * data["options"]["page_size"]
    # three owners, each page exactly one
    owners = {c["page"]: c["owner"] for c in after["pool"]}
    assert sorted(p for p, o in owners.items() if o == "free") == after["free"]
    assert sorted(p for p, o in owners.items() if o == "tree") == sorted(p for n in nodes for p in n["pages"])
    assert sorted(p for p, o in owners.items() if o == f"request {req['uid']}") == sorted(req["own_pages"])
    assert len(owners) == data["options"]["num_pages"] - 1 and "?" not in owners.values()
    assert after["cached_pages"] == sum(o == "tree" for o in owners.values())


def test_the_ragged_layout_is_the_pages_of_a_mixed_step(drawn):
    data = json.loads((drawn / "18-ragged-batch.json").read_text())
    rows, size = data["rows"], data["options"]["page_size"]
    assert [r["kind"] for r in rows] == ["new prompt", "chunk after a cached prefix"] + ["decode row"] * 3
    assert data["chunked"] == [False, True, False, False, False]
    assert rows[1]["cached"] == rows[1]["prefix"] > 0 and all(r["extend"] == 1 for r in rows[2:])
    extend = [r["extend"] for r in rows]
    kv_lens = [r["prefix"] + r["extend"] for r in rows]
    assert data["qo_indptr"] == [sum(extend[:b]) for b in range(len(rows) + 1)]
    assert data["kv_indptr"] == [sum(kv_lens[:b]) for b in range(len(rows) + 1)]
    assert sum(extend) == data["tokens"] <= data["budget"]
    # each request's slots are its pages' slots, position by position; its new ones are the step's out_cache_loc
    slots = [[r["pages"][p // size] * size + p % size for p in range(n)] for r, n in zip(rows, kv_lens)]
    assert data["kv_indices"] == [s for row in slots for s in row]
    assert data["out_cache_loc"] == [s for r, row in zip(rows, slots) for s in row[r["prefix"]:]]
    assert data["max_extend"] == max(extend) and data["max_kv"] == max(kv_lens)


def test_dp_attention_exchanges_three_times_and_the_idle_rank_runs_the_empty_batch(drawn):
    data = json.loads((drawn / "20-dp-exchanges.json").read_text())
    assert [e["exchange"] for e in data["exchanges"]] == ["inbox", "busy", "agree", "replies"]
    inbox, busy, agree, replies = data["exchanges"]
    assert inbox["values"] == [["add", 0]] and inbox["fingerprints_equal"]
    assert busy["values"] == [[0, 0, 0], [0, 0, 0]]                  # nothing yet; the request goes to rank 0
    assert agree["values"] == [[data["prompt_tokens"]], [0]]
    assert replies["values"] == [[{"uid": 0, "tokens": data["tokens"][:1], "finished": False}], []]
    rank0, rank1 = ([e["kind"] for e in lane] for lane in data["lanes"])
    assert rank0 == ["share", "schedule", "agree", "launch", "wait", "process", "reply"]
    assert rank1 == ["share", "agree", "idle"]
    assert all(lane[1 if k else 2]["uids"] == [data["prompt_tokens"], 0] for k, lane in enumerate(data["lanes"]))
