"""Chapter 12: MTP in the overlap loop. Step N+1 is launched from the relay before the host has handled
step N; a request's finish is known one step late (one wasted window, whose tokens reach no client);
the fence's event is recorded in the draft extend, right after its page-table read at the start of that
pass, the step's last read of the page table; chapter 07's four bugs, re-examined with windows; tokens
equal the normal loop's and plain greedy's."""

from __future__ import annotations

import pytest

from conftest import no_hang
from minioverlap import LLM, SamplingParams
from minioverlap.config import Guards
from minioverlap.device.hazard import HazardError
from test_ch07_one_step_late import Plan, run_clients
from test_ch08_fence import fail_the_third_step

K = 3
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", [5, 6, 7], "import os\n", "    for i in range(10):"]


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: one torch thread for the module


def plain_tokens(prompts, params) -> list[list[int]]:
    """Plain greedy decoding, no drafter, the normal loop: the reference every speculative run must give."""
    return [o.token_ids for o in LLM(overlap=False).generate(prompts, params)]


def events(llm: LLM, kind: str, uid: int) -> list[int]:
    """The steps at which the trace has an event `kind` listing request uid."""
    return [e.step for e in llm.trace if e.kind == kind and uid in e.uids]


def windows(llm: LLM, prompt, params: SamplingParams) -> list[list[int]]:
    """One request streamed alone: the tokens of each reply, in order."""
    with no_hang(60):
        return [r.token_ids for r in llm.stream([prompt], params)]


# ---- equal tokens

@pytest.mark.parametrize("k, page_size, max_running", [(1, 4, 2), (2, 1, 3), (3, 16, 2), (4, 4, 1)])
def test_overlap_with_mtp_gives_the_normal_loops_and_plain_greedy_tokens(k, page_size, max_running):
    """Five prompts, max_tokens 1..40, EOS on, fewer request slots than prompts: the overlap loop with MTP
    gives the normal loop's tokens, finish reasons and passes (`verify_steps`: the prefill and the verify
    steps; the wasted window is not counted), and plain greedy's tokens. Integrity holds after each."""
    params = [SamplingParams(max_tokens=n) for n in (40, 1, 17, 33, 9)]
    outs = {}
    for overlap in (False, True):
        llm = LLM(overlap=overlap, mtp_steps=k, page_size=page_size, max_running=max_running, max_seq_len=128)
        with no_hang(60):
            outs[overlap] = [(o.token_ids, o.finish_reason, o.verify_steps) for o in llm.generate(PROMPTS, params)]
        llm.check_integrity()
    assert outs[True] == outs[False]
    assert [tokens for tokens, _, _ in outs[True]] == plain_tokens(PROMPTS, params)


# ---- finishing one step late

def test_a_finish_is_known_one_step_late_one_wasted_window():
    """max_tokens reached inside a window: in the overlap loop the request is in one more launched step
    than it has replies (the wasted window, built before the finish was known), that step replies
    nothing and is not counted as a pass of its tokens, and it is the step right after the finishing one.
    The normal loop launches no such step."""
    params = SamplingParams(max_tokens=13, ignore_eos=True)
    for overlap, wasted in ((False, 0), (True, 1)):
        llm = LLM(overlap=overlap, mtp_steps=K)
        with no_hang(60):
            replies = list(llm.stream(["def fibonacci(n):"], params))
        launched, replied = events(llm, "launch", 0), events(llm, "reply", 0)
        assert len(launched) == len(replied) + wasted == len(replies) + wasted
        assert launched[:len(replied)] == replied
        if wasted:
            assert launched[-1] == replied[-1] + 1, "the wasted window is the step after the finishing one"
        assert sum(len(r.token_ids) for r in replies) == 13 and replies[-1].finished
        [out] = llm.generate(["def fibonacci(n):"], params)
        assert out.verify_steps == len(replies), "a pass per step that replied: the wasted window counts none"
        llm.check_integrity()


def find_cut(ws: list[list[int]]) -> tuple[int, int]:
    """(i, j): a reply i >= 1 of at least 3 tokens and 1 <= j <= len - 2, the token at j new in the run."""
    seen = [t for w in ws[:1] for t in w]
    for i in range(1, len(ws)):
        for j in range(1, len(ws[i]) - 1):
            if ws[i][j] not in seen + ws[i][:j]:
                return i, j
        seen += ws[i]
    raise AssertionError(f"no window to cut in {ws}")


def test_a_stop_inside_a_window_trims_the_rest():
    """A stop token accepted in the middle of a window, in the overlap loop: the client's last reply ends
    on it ('stop'), the window's later tokens and the wasted window's never arrive, and the tokens are
    plain greedy's up to the stop token."""
    free = windows(LLM(overlap=False, mtp_steps=K), "def fibonacci(n):", SamplingParams(max_tokens=40, ignore_eos=True))
    i, j = find_cut(free)
    stop = free[i][j]
    llm = LLM(overlap=True, mtp_steps=K)
    got = run_clients(llm, [Plan(llm.encode("def fibonacci(n):"),
                                 SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop,)))])
    flat = [t for w in free for t in w]
    assert got[0].tokens == flat[:flat.index(stop) + 1] and got[0].finish_reason == "stop"
    assert got[0].replies_after_finish == 0
    assert got[0].tokens == plain_tokens(["def fibonacci(n):"], SamplingParams(max_tokens=40, ignore_eos=True,
                                                                               stop_token_ids=(stop,)))[0]
    llm.check_integrity()


# ---- chapter 07's four bugs, with windows

def test_early_finish_with_windows_a_client_gets_exactly_max_tokens():
    """early-finish: for max_tokens 2..12 (most inside a window) a streaming client gets exactly
    max_tokens tokens, `finished` on the last reply only, and they are plain greedy's."""
    llm = LLM(overlap=True, mtp_steps=K)
    ref = plain_tokens(["class Stack:"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    for n in range(2, 13):
        with no_hang(60):
            replies = list(llm.stream(["class Stack:"], SamplingParams(max_tokens=n, ignore_eos=True)))
        assert [t for r in replies for t in r.token_ids] == ref[:n]
        assert [r.finished for r in replies] == [False] * (len(replies) - 1) + [True]
        assert replies[-1].finish_reason == "length"
    llm.check_integrity()


def test_stale_reply_with_windows_the_wasted_window_replies_nothing():
    """stale-reply: two requests finish inside windows (EOS on, max_tokens) while a step that holds them
    is in flight; each client's stream ends with its finishing reply and nothing after, and the step
    launched after each finish appears in the trace without a reply for it."""
    llm = LLM(overlap=True, mtp_steps=K)
    plans = [Plan(llm.encode(p), SamplingParams(max_tokens=n)) for p, n in (("def fibonacci(n):", 11), ("import os\n", 7))]
    got = run_clients(llm, plans)
    assert all(g.finish_reason is not None and g.replies_after_finish == 0 for g in got)
    assert [g.tokens for g in got] == plain_tokens([p.prompt for p in plans], [p.params for p in plans])
    for uid in (0, 1):
        assert len(events(llm, "launch", uid)) == len(events(llm, "reply", uid)) + 1
    llm.check_integrity()


def handover(*, fence: bool = True, defer_release: bool = False, prompt_on_forward_stream: bool = True,
             max_tokens: int = 5) -> list[list[int]]:
    """One request slot, the checker on: A finishes inside a window while its wasted window is in flight,
    and B, admitted to A's slot, writes its row. Returns both clients' tokens."""
    guards = Guards(fence=fence, defer_release=defer_release, prompt_on_forward_stream=prompt_on_forward_stream)
    llm = LLM(overlap=True, mtp_steps=K, max_running=1, page_size=4, hazard_check=True, guards=guards)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 31))]
    with no_hang(60):
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    llm.check_integrity()
    return [o.token_ids for o in outs]


def test_slot_reuse_with_windows_the_wasted_window_keeps_its_row_from_the_next_owner():
    """slot-reuse: A's slot goes to B while A's wasted window, which reads and writes A's row, is in
    flight. With the fence (the default, release at once) or with chapter 07's deferral instead, the
    checker is silent and both get plain greedy's tokens; with neither guard it names the row."""
    ref = plain_tokens([[5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 31))], SamplingParams(max_tokens=5, ignore_eos=True))
    assert handover() == ref
    assert handover(fence=False, defer_release=True) == ref
    with pytest.raises(HazardError, match=r"req_to_token row 1, positions 0\.\.10: write on the schedule stream"):
        handover(fence=False)


def test_abort_in_flight_with_windows_frees_once_and_drops_the_steps_result():
    """abort-in-flight: aborts that arrive while a verify step holding the request is in flight (after
    1..4 replies), with a third request waiting for a slot and chapter 07's deferral as the only guard
    (fence off, the checker on): the request is freed exactly once and not while that step still uses
    its row, its only reply after the abort is the abort, and the others get plain greedy's tokens."""
    prompts, params = ["def fibonacci(n):", "class Stack:", [5, 6, 7]], SamplingParams(max_tokens=16, ignore_eos=True)
    ref = plain_tokens(prompts, params)
    for after in range(1, 5):
        llm = LLM(overlap=True, mtp_steps=K, max_running=2, page_size=4, hazard_check=True,
                  guards=Guards(fence=False, defer_release=True))
        released = []
        release = llm.runner.release
        llm.runner.release = lambda req: released.append(req.uid) or release(req)
        replies = []
        with no_hang(60):
            for reply in llm.stream(prompts, params):
                replies.append(reply)
                if reply.uid == 0 and len([r for r in replies if r.uid == 0]) == after:
                    assert any(o.batch.mode.value == "verify" and 0 in [r.uid for r in o.batch.reqs]
                               for o in llm.scheduler.in_flight), "a verify step holding it is in flight"
                    llm.abort(0)
        a = [r for r in replies if r.uid == 0]
        assert (a[-1].token_ids, a[-1].finish_reason) == ([], "abort") and len(a) == after + 1
        assert released.count(0) == 1
        for uid in (1, 2):
            assert [t for r in replies if r.uid == uid for t in r.token_ids] == ref[uid]
        llm.check_integrity()


# ---- the fence with MTP

def test_the_checker_is_silent_with_the_defaults_and_names_the_row_without_the_fence():
    """With the defaults, a recycled slot whose previous owner's wasted window is in flight raises
    nothing; without the fence the checker names the race: the scheduler's write of the new owner's
    row against the draft extend's read of the page table (SGLang #18803)."""
    assert handover() == plain_tokens([[5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 31))],
                                      SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(HazardError, match=r"write on the schedule stream .*the scheduler writes the KV slots of row 1"
                                          r".*read on the forward stream \(step \d+: the draft extend reads the page table\)"):
        handover(fence=False)


def test_with_mtp_the_fence_orders_the_scheduler_s_prompt_write_too():
    """Chapter 08's other guard, the prefill writing its own prompt on the forward stream, is not needed in
    a speculative run: the event comes after every token_pool write of the step (the drafts, the accepted
    window, a prefill's bonus token), so the fence orders them before the scheduler's prompt write into a
    recycled row. With that guard off the checker is silent and the tokens are plain greedy's."""
    assert handover(prompt_on_forward_stream=False) == plain_tokens(
        [[5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 31))], SamplingParams(max_tokens=5, ignore_eos=True))


def test_the_read_done_event_comes_after_the_draft_extend_reads_the_page_table():
    """The fence's event is recorded after the step's last read of a table the scheduler writes, which with
    MTP is the draft extend's page-table read: in the checker's records of each step, the event comes
    right after that read, and every read of req_to_token or token_pool by the step comes before it."""
    llm = LLM(overlap=True, mtp_steps=K, hazard_check=True)
    checker, log = llm.runner.hazards, []
    access, record = checker.access, llm.runner.streams.record

    def logged_access(name, cells, kind, site):
        log.append((checker.step, name, kind, site))
        return access(name, cells, kind, site)

    def logged_record(*args):
        log.append((checker.step, "event", None, None))
        return record(*args)

    checker.access, llm.runner.streams.record = logged_access, logged_record
    with no_hang(60):
        llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=12, ignore_eos=True))
    extends = [i for i, (_, name, _, site) in enumerate(log) if site == "the draft extend reads the page table"]
    assert len(extends) >= 3, "a prefill and verify steps"
    for i in extends:
        step = log[i][0]
        assert log[i + 1] == (step, "event", None, None), "the event right after the draft extend's read"
        reads = [j for j, (s, name, kind, _) in enumerate(log)
                 if s == step and kind == "read" and name in ("req_to_token", "token_pool")]
        assert max(reads) == i, f"step {step} reads a shared table after its event: {log[max(reads)]}"


def test_the_checker_is_told_of_every_cell_a_window_touches():
    """The host does not know where a window starts, so it tells the checker of every cell the window may
    touch. For every verify of a run in which the host lags (the overlap loop), the cells the device
    actually read and wrote (the window laid out from the relay: the slot lookups at L..L+k, the drafts at
    L+1..L+k, the accepted tokens at L+1..L+k+1) are among those recorded."""
    llm = LLM(overlap=True, mtp_steps=K, max_running=2, page_size=4, hazard_check=True)
    tables, checked = llm.runner.tables, []
    record = tables.record

    def recording(name, cells, kind, site):
        recording.last = set(cells())
        return record(name, cells, kind, site)

    def watched(method, first, last):
        def run(batch, *args):
            result = method(batch, *args)
            W = batch.extend_lens[0]
            positions = args[0] if method.__name__ == "kv_slots_at" else batch.positions.view(len(batch.reqs), W)
            starts = positions[:, 0].tolist()
            actual = {(row, L + j) for row, L in zip(batch.rows, starts) for j in range(first, last)}
            assert actual <= recording.last, f"{method.__name__}: {sorted(actual - recording.last)} not recorded"
            checked.append(method.__name__)
            return result
        return run

    tables.record = recording
    tables.kv_slots_at = watched(tables.kv_slots_at, 0, K + 1)
    tables.write_drafts = watched(tables.write_drafts, 1, K + 1)
    tables.write_window = watched(tables.write_window, 1, K + 2)
    with no_hang(60):
        llm.generate(PROMPTS[:3], SamplingParams(max_tokens=24, ignore_eos=True))
    assert checked.count("write_window") >= 10


def test_the_fence_waits_on_the_event_of_the_step_just_launched():
    """Each launch fences on the read-done event its own step recorded (not an older one, not a shared
    mailbox that a later launch re-records): the event the schedule stream waits on after launching step
    N is step N's batch's (events exist on CPU when the checker records them)."""
    llm = LLM(overlap=True, mtp_steps=K, max_running=2, hazard_check=True)
    sched, waited = llm.scheduler, []
    fence = llm.runner.streams.fence
    llm.runner.streams.fence = lambda event: waited.append(event) or fence(event)
    launch = sched.launch

    def launched(batch):
        out = launch(batch)
        assert waited[-1] is out.read_done and waited[-1] is not None
        return out

    sched.launch = launched
    with no_hang(60):
        llm.generate(PROMPTS[:3], SamplingParams(max_tokens=10))
    assert len(set(map(id, waited))) == len(waited) == sched.step


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_the_run_after_a_failed_verify_step_is_no_race(overlap):
    """Chapter 08's failed step with MTP: a step that raises after its reads (here the third step, a
    verify step, once its target pass has read its inputs) is waited for, and the next run equals a
    fresh engine's."""
    llm = LLM(model="tiny", overlap=overlap, mtp_steps=K, hazard_check=True, page_size=4, max_running=2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    fresh = [o.token_ids for o in llm.generate(["def f(x):", "class A:"], params)]
    fail_the_third_step(llm, KeyboardInterrupt())
    assert [o.token_ids for o in llm.generate(["def f(x):", "class A:"], params)] == fresh
    llm.check_integrity()
