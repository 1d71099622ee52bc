"""Chapter 19: a grammar compiles off the scheduler's path. Its compile runs in the backend's thread; the
request waits in the grammar queue, passed over, while the requests behind it run, and joins the waiting
ones at the first iteration after its compile is done. Each test holds the compile at a gate (a
threading.Event) and opens it when the stream has shown what it must: a plain request that finishes
while a grammar compiles, in both loops. The gate opens by itself after GATE_S, so that a scheduler that
waited for the compile fails the test rather than hangs it. The same grammar compiles once; one that does
not compile fails its request alone, naming its field, and leaves the engine as a fresh one's."""

from __future__ import annotations

import threading

import pytest

from minioverlap import LLM, SamplingParams
from minioverlap.constrained.grammar import GrammarBackend

SCHEMA = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
GRAMMAR = SamplingParams(max_tokens=48, json_schema=SCHEMA)
PLAIN = SamplingParams(max_tokens=12)
PROMPTS = ["x = {", "def fibonacci(n):"]            # the grammar request first: it must not block the plain one
GATE_S = 20.0                                         # a scheduler that waits for the compile waits this long


class Gate:
    """GrammarBackend.compile held until `open()`: the compiles asked for, and whether one outwaited the gate."""

    def __init__(self, monkeypatch) -> None:
        self.event, self.kinds, self.waited_out = threading.Event(), [], False
        compile_ = GrammarBackend.compile

        def held(backend, kind, source):
            self.kinds.append(kind)
            self.waited_out |= not self.event.wait(GATE_S)
            return compile_(backend, kind, source)
        monkeypatch.setattr(GrammarBackend, "compile", held)

    def open(self) -> None:
        self.event.set()


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each prompt's tokens run alone, without a gate: the grammar request's and the plain one's."""
    llm = LLM(overlap=False)
    return [llm.generate(p, params)[0].token_ids for p, params in zip(PROMPTS, [GRAMMAR, PLAIN])]


def stream(llm: LLM, gate: Gate, params: list[SamplingParams]) -> tuple[list, dict[int, list[int]]]:
    """The replies, and each request's tokens by its place in PROMPTS (its uid: llm.next_uid before, + the
    place); the gate opened once the plain request (the second) has finished."""
    replies, first = [], llm.next_uid
    for reply in llm.stream(PROMPTS, params):
        replies.append(reply)
        if reply.uid == first + 1 and reply.finished:
            gate.open()
    gate.open()
    return replies, {i: [t for r in replies if r.uid == first + i for t in r.token_ids] for i in range(2)}


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_plain_request_runs_to_its_end_while_a_grammar_compiles(overlap, monkeypatch, alone):
    """The grammar request comes first, and its compile is held: the plain request behind it is not blocked,
    and runs every step to its end; then the gate opens and the grammar request is admitted (`grammar`,
    then its first schedule) and gives what it gives alone."""
    llm = LLM(overlap=overlap)
    gate = Gate(monkeypatch)
    grammar_uid, plain_uid = llm.next_uid, llm.next_uid + 1
    replies, tokens = stream(llm, gate, [GRAMMAR, PLAIN])
    assert not gate.waited_out, f"the gate opened by itself after {GATE_S} s: the scheduler waited for the compile"
    done = next(i for i, r in enumerate(replies) if r.uid == plain_uid and r.finished)
    assert not [r for r in replies[:done] if r.uid == grammar_uid], "a grammar request replied before its compile"
    assert tokens == {0: alone[0], 1: alone[1]}
    kinds = [(e.kind, e.uids) for e in llm.trace if e.kind in ("schedule", "grammar")]
    admitted = kinds.index(("grammar", (grammar_uid,)))
    plain_steps = [k for k in kinds[:admitted] if k == ("schedule", (plain_uid,))]
    assert len(plain_steps) >= PLAIN.max_tokens, kinds    # every step of the plain request, the grammar held
    assert all(grammar_uid not in uids for _, uids in kinds[:admitted])
    assert gate.kinds == ["json_schema"]
    llm.check_integrity()


def test_a_grammar_asked_for_again_compiles_once(monkeypatch, alone):
    """Two requests with the same schema, in one run and in the next, and one with a regex: two compiles
    (the backend keeps a future per grammar), and the same tokens as alone."""
    llm = LLM(overlap=True)
    gate = Gate(monkeypatch)
    gate.open()
    regex = SamplingParams(max_tokens=8, regex=r"\d{3}-\d{4}")
    outs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1]], [GRAMMAR, GRAMMAR, regex])
    assert [o.token_ids for o in outs[:2]] == [alone[0], alone[0]]
    assert llm.generate(PROMPTS[0], GRAMMAR)[0].token_ids == alone[0]
    assert sorted(gate.kinds) == ["json_schema", "regex"]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_grammar_that_does_not_compile_fails_its_request_alone(overlap, monkeypatch, alone):
    """xgrammar's RuntimeError in the backend's thread: the request fails alone, its error naming the field
    and giving xgrammar's complaint; the plain request runs as alone, nothing is held, and the next run (the
    same grammar compiling now) is a fresh engine's."""
    llm = LLM(overlap=overlap)
    compile_ = GrammarBackend.compile
    fail = [True]

    def failing(backend, kind, source):
        if fail[0]:
            raise RuntimeError("[17:45:17] /xgrammar/cpp/grammar_compiler.cc:42: the vocabulary says no")
        return compile_(backend, kind, source)
    monkeypatch.setattr(GrammarBackend, "compile", failing)
    first = llm.next_uid
    replies = list(llm.stream(PROMPTS, [GRAMMAR, PLAIN]))
    [failed] = [r for r in replies if r.finish_reason == "error"]
    assert (failed.uid, failed.token_ids) == (first, [])
    assert failed.error == "json_schema did not compile against the vocabulary: the vocabulary says no"
    assert [t for r in replies if r.uid == failed.uid + 1 for t in r.token_ids] == alone[1]
    llm.check_integrity()
    assert not (llm.scheduler.grammars.queue or llm.scheduler.grammars.compiling or llm.scheduler.busy)
    fail[0] = False
    llm.processor.grammars.futures.clear()          # the failed compile is kept: forget it, to compile again
    assert [o.token_ids for o in llm.generate(PROMPTS, [GRAMMAR, PLAIN])] == alone


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_an_abort_reaches_a_request_whose_grammar_compiles(overlap, monkeypatch, alone):
    """Aborted in the grammar queue: its reply says abort, it never runs, and once its compile ends the
    engine holds nothing and serves as a fresh one."""
    llm = LLM(overlap=overlap)
    gate = Gate(monkeypatch)
    replies, first = [], llm.next_uid
    for reply in llm.stream(PROMPTS, [GRAMMAR, PLAIN]):
        replies.append(reply)
        if len(replies) == 1:
            llm.abort(first)
        if reply.uid == first + 1 and reply.finished:
            gate.open()
    gate.open()
    assert [(r.token_ids, r.finish_reason) for r in replies if r.uid == first] == [([], "abort")]
    assert not gate.waited_out
    llm.check_integrity()
    assert [o.token_ids for o in llm.generate(PROMPTS, [GRAMMAR, PLAIN])] == alone
