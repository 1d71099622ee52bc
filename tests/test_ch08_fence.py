"""Chapter 08: the fence and the stream hazard checker. The checker's rules on their own; silence over
chapter 07's random schedules with the engine's defaults; and, for each guard of a shared write, the
scenario in which removing that guard alone makes the checker raise, naming the table and the elements."""

from __future__ import annotations

import random
import re

import pytest
import torch

from conftest import run_example, sampled
from minioverlap import LLM, SamplingParams
from minioverlap.config import Guards
from minioverlap.device.hazard import HazardChecker, HazardError
from minioverlap.device.streams import Streams
from test_ch07_one_step_late import Plan, random_plans, run_clients, stop_token_after


# ---- the checker's rules

def test_stream_order_events_and_host_waits_order_accesses():
    h = HazardChecker()
    h.current = "forward"
    h.access("t", [(1, 0)], "read", "step reads")
    h.access("t", [(1, 0)], "write", "same stream: in order")       # stream order: no race
    done = h.record()
    h.current = "schedule"
    with pytest.raises(HazardError, match=r"t row 1, position 0: write on the schedule stream .* and write on the forward stream"):
        h.access("t", [(1, 0)], "write", "unordered")
    h.wait_event(done)                                                # an event wait orders it
    h.access("t", [(1, 0)], "write", "after the event")
    h.current = "forward"
    h.access("t", [(1, 1)], "write", "forward again")
    h.host_wait(h.record(), "host sync")                              # the host has seen it finish ...
    h.current = "schedule"
    h.access("t", [(1, 1)], "read", "queued after the host sync")    # ... so what it queues next follows
    assert h.host_waits == ["host sync"]


def test_appending_to_a_row_the_step_reads_is_no_race():
    """Element granularity: the scheduler writes position 5 of a row whose positions 0..4 a running
    step reads. Writing position 4 instead is a race, and the report says which element."""
    h = HazardChecker()
    h.current = "forward"
    h.access("req_to_token", [(3, i) for i in range(5)], "read", "the step reads the page table")
    h.current = "schedule"
    h.access("req_to_token", [(3, 5)], "write", "append")
    with pytest.raises(HazardError, match=r"req_to_token row 3, position 4: write .* read on the forward stream"):
        h.access("req_to_token", [(3, 4)], "write", "overwrite")


def test_the_fence_waits_for_the_event_or_else_for_the_whole_forward_stream():
    """With an event declared, the schedule stream follows the reads before it, not the writes after;
    with none, it follows everything queued on the forward stream."""
    for declared in (True, False):
        h = HazardChecker()
        streams = Streams("cpu", h)
        with streams.schedule():
            with streams.forward():
                h.access("token_pool", [(1, 0)], "read", "the step reads")
                read_done = streams.record()
                h.access("token_pool", [(1, 1)], "write", "the sampler writes")
            streams.fence(read_done if declared else None)
            h.access("token_pool", [(1, 0)], "write", "the scheduler rewrites what was read")   # ordered either way
            if declared:
                with pytest.raises(HazardError, match="token_pool row 1, position 1"):
                    h.access("token_pool", [(1, 1)], "write", "the scheduler rewrites what the sampler wrote")
            else:
                h.access("token_pool", [(1, 1)], "write", "the scheduler rewrites what the sampler wrote")


# ---- the tables record their own accesses

def step_tables(kv_slots: list[int]):
    """Request slot 1 holding len(kv_slots) tokens, the checker on, and a one-request decode batch of it."""
    from types import SimpleNamespace

    from minioverlap.cache.req_to_token import ReqToTokenPool

    h = HazardChecker()
    streams, tables = Streams("cpu", h), ReqToTokenPool(2, 16, "cpu", h)
    n = len(kv_slots)
    batch = SimpleNamespace(rows=[1], prefix_lens=[n - 1], extend_lens=[1], max_seq_len=n,
                            req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([n]))
    batch.page_cells = lambda: [(1, i) for i in range(n)]
    return h, streams, tables, batch


def test_a_single_slot_append_over_a_read_in_flight_raises():
    """A decode's slot append is a scheduler write of one element. Written into a position the running
    step's page-table read covers, with no fence, it races, and the checker sees that one element."""
    h, streams, tables, batch = step_tables([5, 6, 7])
    with streams.schedule():
        tables.write(1, 0, [5, 6, 7])
        with streams.forward():
            tables.page_table(batch)                     # the step reads positions 0..2 of row 1
        tables.write(1, 3, [8])                          # an append past them: no race
        with pytest.raises(HazardError, match=r"req_to_token row 1, position 2: write on the schedule stream"):
            tables.write(1, 2, [9])                      # one element it read: a race


def test_a_page_table_read_after_the_read_done_event_is_a_race_behind_the_fence():
    """The fence covers the reads made before the step's read-done event, and no later one: a pass that
    read req_to_token after the event (a layer reading the table again, say) races with the scheduler's
    next write behind the fence. The checker sees it because the read is recorded where it happens."""
    for late_read in (False, True):
        h, streams, tables, batch = step_tables([5, 6, 7])
        with streams.schedule():
            tables.write(1, 0, [5, 6, 7])
            with streams.forward():
                tables.page_table(batch)
                read_done = streams.record()
                if late_read:
                    tables.page_table(batch)
            streams.fence(read_done)
            if late_read:
                with pytest.raises(HazardError, match=r"read on the forward stream \(step 0: attention reads the page table\)"):
                    tables.write(1, 0, [9])
            else:
                tables.write(1, 0, [9])                  # behind the fence: ordered after the read


# ---- the engine with its defaults

@pytest.mark.parametrize("seed", sampled(list(range(16)), range(4)))
def test_defaults_are_silent_over_random_schedules(seed):
    """Chapter 07's random schedules with the checker on: no HazardError in either loop, the same
    replies as without the checker, and the only host waits are the copy-done waits, one per step."""
    rng = random.Random(seed)
    engine = dict(page_size=rng.choice([1, 2, 4, 16]), max_running=rng.randint(1, 4), max_seq_len=64)
    engine["num_pages"] = 64 // engine["page_size"] * rng.randint(1, 3) + 1
    plain = LLM(model="tiny", **engine)
    stops = [plain.encode(s)[0] for s in ("\n", "(", " =", ":", ",")]
    plans = random_plans(rng, stops)
    expected = run_clients(plain, plans)
    for overlap in (False, True):
        llm = LLM(model="tiny", **engine, overlap=overlap, hazard_check=True)
        assert run_clients(llm, plans) == expected
        waits = llm.runner.hazards.host_waits               # of every run (a late client gets a run of its own)
        assert all(re.fullmatch(r"the host waits for step \d+'s tokens", w) for w in waits)
        steps = max(e.step for e in llm.trace)              # the last run: one wait per step, no other
        assert sorted(waits[-steps:]) == sorted(f"the host waits for step {n}'s tokens" for n in range(1, steps + 1))
        llm.check_integrity()


def test_the_fence_opens_after_the_step_reads_not_at_its_end():
    """After a launch, the schedule stream follows the step's shared reads but not its sampler write:
    the scheduler's next writes may run while the step computes."""
    llm = LLM(model="tiny", hazard_check=True)
    sched, h = llm.scheduler, llm.runner.hazards
    sched.add_request(llm.make_requests("def f(x):", SamplingParams(max_tokens=2))[0])
    with llm.runner.streams.schedule():
        last, _ = sched.overlap_loop(None)                  # step 1 launched, fenced
    read_done = last.read_done.clock["forward"]
    assert h.clocks["schedule"]["forward"] == read_done < h.clocks["forward"]["forward"]


def test_hazard_check_off_costs_nothing():
    llm = LLM(model="tiny")
    assert llm.runner.hazards is None and llm.runner.tables.hazards is None and llm.runner.streams.hazards is None
    if llm.runner.device.type == "cpu":
        assert llm.runner.streams.record() is None         # no event at all: nothing to wait for on a CPU
    checked = LLM(model="tiny", hazard_check=True)
    prompts, params = ["def f(x):", "import os\n"], SamplingParams(max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in checked.generate(prompts, params)] == [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("field, value", [("fence", "yes"), ("hazard_check", 1)])
def test_bad_guard_flags_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} must be True or False, got {value!r}"):
        LLM(model="tiny", **{field: value})


@pytest.mark.parametrize("field", ["fence", "defer_release", "prompt_on_forward_stream"])
def test_bad_guards_are_refused(field):
    with pytest.raises(ValueError, match=f"{field} must be True or False, got 'no'"):
        Guards(**{field: "no"})


def test_fence_false_beside_guards_is_refused():
    """fence=False and a Guards(...) of its own would disagree about the fence: refused, naming both."""
    with pytest.raises(ValueError, match="fence=False and guards=Guards"):
        LLM(model="tiny", fence=False, guards=Guards())


# ---- each guard, removed alone

def slot_handover(*, fence: bool = True, defer_release: bool = False, prompt_on_forward_stream: bool = True,
                  overlap: bool = True, **engine) -> tuple[HazardError | None, int, int]:
    """One request slot. A finishes on a stop token at step k; step k+1, which still reads and writes A's
    row, is in flight when the row could go to B, whose prompt is longer than A's sequence.
    Returns (the checker's error or None, A's length in step k+1, B's prompt length). `engine`: more of
    LLM's options (a later chapter's)."""
    guards = Guards(fence=fence, defer_release=defer_release, prompt_on_forward_stream=prompt_on_forward_stream)
    llm = LLM(model="tiny", overlap=overlap, max_running=1, page_size=4, hazard_check=True, guards=guards, **engine)
    a, b = llm.encode("def f(x):"), llm.encode("class Stack:\n    def __init__(self):\n        self.items = []")
    plans = [Plan(a, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop_token_after(llm, a, 2),))),
             Plan(b, SamplingParams(max_tokens=4, ignore_eos=True))]
    try:
        got = run_clients(llm, plans)
    except HazardError as error:
        return error, -1, len(b)
    assert got[0].finish_reason == "stop" and len(got[1].tokens) == 4
    return None, len(a) + len(got[0].tokens), len(b)


def test_every_guard_in_place_silence():
    for guards in ({}, {"defer_release": True}, {"fence": False, "defer_release": True},
                   {"prompt_on_forward_stream": False, "defer_release": True}, {"overlap": False, "fence": False}):
        error, a_len, b_len = slot_handover(**guards)
        assert error is None, guards
        assert b_len > a_len          # B's prompt covers every position of A's row


def fail_the_third_step(llm: LLM, error: BaseException) -> None:
    """A run whose third step raises `error` once it has read its inputs and the page tables (an
    exception or a Ctrl-C inside the step, eager or, on a GPU, graphed): the step reaches neither the
    fence nor `in_flight`."""
    read_inputs, calls = llm.runner.read_inputs, []

    def failing(batch):
        input_ids = read_inputs(batch)          # the step's reads of the shared tables are queued
        calls.append(1)
        if len(calls) == 3:
            raise error
        return input_ids

    llm.runner.read_inputs = failing
    try:
        with pytest.raises(type(error)):
            llm.generate(["def f(x):", "class A:", "import os"], SamplingParams(max_tokens=8, ignore_eos=True))
    finally:
        del llm.runner.read_inputs


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("error", [RuntimeError("planted failure"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_the_run_after_a_failed_step_is_no_race(overlap, error):
    """A failed step's queued reads are waited for before anything runs after it: the next run's
    writes to the rows it read are ordered after them, and its tokens are a fresh engine's. What the
    failed run's abandon writes (from chapter 17, a freed request's row, its pages given to the tree) is
    queued on a stream too, never on the host's: on a GPU that is the default stream, in no order with
    the next run's writes to the same row, a race the checker (whose host is in order with everything)
    cannot see, and that changes the tokens only when the device happens to run it late."""
    llm = LLM(model="tiny", overlap=overlap, hazard_check=True, page_size=4, max_running=2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    fresh = [o.token_ids for o in llm.generate(["def f(x):", "class A:"], params)]
    on_the_host = host_accesses(llm)
    fail_the_third_step(llm, error)
    assert [o.token_ids for o in llm.generate(["def f(x):", "class A:"], params)] == fresh
    assert on_the_host == [], f"accesses to shared tables outside both streams: {on_the_host}"
    llm.check_integrity()


def host_accesses(llm: LLM) -> list[str]:
    """From now on, every access to a shared table that the checker sees made on the host's stream (outside
    the schedule and forward streams), as "table kind (site)"."""
    checker, made = llm.runner.hazards, []
    access = checker.access

    def watched(table, elements, kind, site):
        if checker.current == "host":
            made.append(f"{table} {kind} ({site})")
        return access(table, elements, kind, site)

    checker.access = watched
    return made


def test_fence_off_the_scheduler_rewrites_a_page_table_the_step_still_reads():
    """Release at once with no fence: B's KV slots go into row 1 while step k+1 may still read A's."""
    _, a_len, _ = slot_handover()
    error, _, _ = slot_handover(fence=False)
    assert error is not None
    assert str(error).startswith(f"req_to_token row 1, positions 0..{a_len - 1}: write on the schedule stream")
    assert "the scheduler writes the KV slots of row 1" in str(error)
    assert "read on the forward stream" in str(error) and "attention reads the page table" in str(error)


def test_deferral_reverted_with_no_fence_the_same_race():
    """Chapter 07's guard alone (no fence) is enough; revert it and the same write races."""
    assert slot_handover(fence=False, defer_release=True)[0] is None
    error, _, _ = slot_handover(fence=False, defer_release=False)
    assert error is not None and str(error).startswith("req_to_token row 1, positions 0..")


def test_prompt_written_on_the_schedule_stream_races_with_the_sampler():
    """The fence opens after the step's reads, before its sampler writes A's next token into
    token_pool. B's prompt, written by the scheduler, may land before or after that write."""
    _, a_len, _ = slot_handover()
    error, _, _ = slot_handover(prompt_on_forward_stream=False)
    assert error is not None
    assert str(error).startswith(f"token_pool row 1, position {a_len}: write on the schedule stream")
    assert "write on the forward stream" in str(error) and "the sampler writes the next input tokens" in str(error)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_launch_path_never_blocks_the_host():
    """On a GPU: schedule and launch run under torch.cuda.set_sync_debug_mode('error'), so any call
    that makes the host wait for the device raises. The copy-done wait is outside them, in `wait`."""
    llm = LLM(model="tiny", device="cuda", dtype="float32")
    sched = llm.scheduler
    schedule, launch = sched.schedule, sched.launch

    def strict(fn):
        def run(*args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run

    llm.generate(["warm up"], SamplingParams(max_tokens=2))          # lazy CUDA initialisation out of the way
    sched.schedule, sched.launch = strict(schedule), strict(launch)
    outs = llm.generate(["def f(x):", "import os\n"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8]


# ---- the checker against a brute-force oracle

def random_history(rng: random.Random, length: int = 12) -> list[tuple]:
    """Random accesses on two streams to six elements, with events recorded, waited for and synced."""
    ops, recorded = [], []
    for _ in range(length):
        stream = rng.choice(["schedule", "forward"])
        choice = rng.random()
        if choice < 0.5:
            ops.append(("access", stream, rng.choice(["read", "write"]), rng.randrange(6)))
        elif choice < 0.7:
            recorded.append(len(ops))
            ops.append(("record", stream))
        elif recorded and choice < 0.9:
            ops.append(("wait", stream, rng.choice(recorded)))
        elif recorded:
            ops.append(("host_wait", rng.choice(recorded)))
    return ops


def first_race_by_oracle(ops: list[tuple]) -> int | None:
    """The index of the first access that races with an earlier one, from the happens-before graph
    built op by op: stream order; a wait follows the record it waits for; whatever the host queues after
    a host wait follows the record it waited for; and happens-before is the transitive closure."""
    before: list[set[int]] = []            # before[i]: every op that happens before op i
    last_on: dict[str, int] = {}
    host_seen: set[int] = set()            # ops the host has waited for (and all before them)
    for i, op in enumerate(ops):
        preds = set(host_seen)
        if op[0] == "host_wait":
            host_seen |= {op[1]} | before[op[1]]
            before.append(set(preds))
            continue
        stream = op[1]
        if stream in last_on:
            preds |= {last_on[stream]} | before[last_on[stream]]
        if op[0] == "wait":
            preds |= {op[2]} | before[op[2]]
        before.append(preds)
        last_on[stream] = i
        if op[0] == "access":
            for j in range(i):
                other = ops[j]
                if (other[0] == "access" and other[3] == op[3] and "write" in (other[2], op[2])
                        and j not in preds):
                    return i
    return None


def first_race_by_checker(ops: list[tuple]) -> int | None:
    h, events = HazardChecker(), {}
    for i, op in enumerate(ops):
        if op[0] == "host_wait":
            h.host_wait(events[op[1]], "host wait")
            continue
        h.current = op[1]
        if op[0] == "record":
            events[i] = h.record()
        elif op[0] == "wait":
            h.wait_event(events[op[2]])
        else:
            try:
                h.access("t", [(0, op[3])], op[2], f"op {i}")
            except HazardError:
                return i
    return None


def test_the_checker_agrees_with_a_brute_force_oracle_on_random_histories():
    """Vector clocks with one write and one read per stream per element must find exactly the races
    that the full happens-before graph finds, at the same access, on 3000 random histories."""
    rng = random.Random(0)
    races = 0
    for _ in range(3000):
        ops = random_history(rng)
        expected = first_race_by_oracle(ops)
        assert first_race_by_checker(ops) == expected, ops
        races += expected is not None
    assert 500 < races < 2500              # both outcomes are well represented


@pytest.mark.process
def test_the_example_shows_the_checker_silent_with_every_guard_and_a_race_without_one():
    """`python examples/ch08_fence.py`: silent with the defaults and with the deferral instead of the
    fence; with the fence off a race on req_to_token, with the prompt on the schedule stream a race on
    token_pool; and the deferral never makes fewer launches with nothing in flight than release at once."""
    import re
    out = run_example("examples/ch08_fence.py")
    lines = out.splitlines()
    after = {label: lines[lines.index(label) + 1].strip() for label in (
        "defaults: fence on, slot released at once, prompt written by its prefill", "fence off",
        "fence off, chapter 07's deferred release instead", "prompt written by the scheduler, on the schedule stream")}
    silent, fence_off, deferred, prompt = after.values()
    assert silent.startswith("silent (") and deferred.startswith("silent (")
    assert fence_off.startswith("HazardError: req_to_token row 1, positions 0..")
    assert prompt.startswith("HazardError: token_pool row 1, position ")
    rows = re.findall(r"│ (\d) +│ (deferred|at once) \(\w+\) +│ (\d+) +│ (\d+) +│", out)
    idle = {(int(m), release): int(n) for m, release, n, _ in rows}
    assert len(idle) == 6 and all(idle[m, "deferred"] >= idle[m, "at once"] for m in (1, 2, 4))
