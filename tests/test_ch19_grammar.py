"""Chapter 19: grammar-constrained sampling, in both loops, with and without MTP. The tiny model's greedy output under a JSON
schema parses and validates (an object of typed properties, an enum, an array of integers with maxItems,
nested objects), under a regex matches it whole, under json_object is a JSON object; in a batch that mixes
constrained and free requests the free ones' tokens equal a run without a grammar; the grammar that ends
ends its request ("stop"), with ignore_eos too; a grammar that allows no token, or a token it forbids, fails
its request alone; every bad input is refused naming its field, and the engine then equals a fresh one.
Constrained greedy tokens are the same in the four configurations (the overlap loop's put-off sample, MTP's
masked windows: lossless), and the overlap loop fills a step's masks only after the step before is handled."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from minioverlap import LLM, SamplingParams
from minioverlap.config import Guards
from minioverlap.constrained import grammar
from minioverlap.constrained.grammar import Grammar
from minioverlap.device.hazard import HazardError

PROMPTS = ["def fibonacci(n):", "x = {", "import json\ndata = "]
FREE = ["class Stack:", "    for i in range(10):"]
LONG = "import os\n" + "x = [1, 2, 3]\nprint(x)\n" * 10          # 153 tokens, over a step's budget of BUDGET: chunked
BUDGET = 64                                                      # asked for: a GPU's default, 8192, chunks nothing
SCHEMAS = {
    "typed-object": {"type": "object", "required": ["name", "age", "admin"],
                     "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                    "admin": {"type": "boolean"}}},
    "enum": {"enum": ["red", "green", "blue"]},
    "int-array": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    "nested": {"type": "object", "required": ["point", "tags"],
               "properties": {"point": {"type": "object", "required": ["x", "y"],
                                        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}},
                              "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}}},
}
PHONE = r"\d{3}-\d{4}"
EOS = 0                                                 # the tiny model's <|endoftext|>


CONFIGS = {"normal": dict(overlap=False), "overlap": dict(overlap=True),
           "normal-mtp3": dict(overlap=False, mtp_steps=3), "overlap-mtp3": dict(overlap=True, mtp_steps=3),
           "overlap-ngram3": dict(overlap=True, ngram_steps=3)}


@pytest.fixture(scope="module", params=CONFIGS)
def llm(request) -> LLM:
    return LLM(**CONFIGS[request.param], hazard_check=True)


@pytest.fixture(scope="module")
def normal_tokens() -> dict[str, list[list[int]]]:
    """The normal loop's constrained greedy tokens, without MTP: every schema, over every prompt."""
    llm = LLM(overlap=False)
    return {name: [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=64, json_schema=schema))]
            for name, schema in SCHEMAS.items()}


@pytest.fixture(scope="module")
def free_tokens(llm) -> list[list[int]]:
    """The free prompts' greedy tokens, run without any grammar."""
    return [o.token_ids for o in llm.generate(FREE, SamplingParams(max_tokens=24))]


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "json-text"])
def test_greedy_output_validates_against_its_schema(llm, name, as_text):
    """Each prompt's greedy output, under the schema (given as a dict or as its JSON text), ends where its
    JSON ends (the EOS the grammar allows only there: "stop") and validates against the schema."""
    schema = json.dumps(SCHEMAS[name]) if as_text else SCHEMAS[name]
    for out in llm.generate(PROMPTS, SamplingParams(max_tokens=64, json_schema=schema)):
        assert out.finish_reason == "stop" and out.token_ids[-1] == EOS, out
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    llm.check_integrity()


def test_constrained_tokens_equal_the_normal_loop_s(llm, normal_tokens):
    """The overlap loop (its sample put off until the step before is handled) and MTP (each window's rows
    masked along its drafts, the accept rule over them) give the normal loop's constrained greedy tokens
    exactly, for every schema; with MTP some windows accept drafts."""
    for name, schema in SCHEMAS.items():
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, json_schema=schema))
        assert [o.token_ids for o in outs] == normal_tokens[name], name
    if llm.args.mtp_steps:
        assert sum(o.verify_steps for o in outs) < sum(len(o.token_ids) for o in outs)
    llm.check_integrity()


def test_a_constrained_request_that_arrives_mid_run_equals_the_normal_loop_s(llm, normal_tokens):
    """A free stream runs; after its third token a constrained request arrives (its prefill launched while a
    step is in flight, a step it is not in: its first mask is ready), then more decode steps hold both.
    Its tokens are the normal loop's alone, and the stream's its own alone."""
    free = SamplingParams(max_tokens=24)
    alone = llm.generate(FREE[0], free)[0].token_ids
    tokens: dict[int, list[int]] = {}
    for reply in llm.stream(FREE[0], free):
        tokens.setdefault(reply.uid, []).extend(reply.token_ids)
        if len(tokens) == 1 and len(tokens[reply.uid]) >= 3:
            tokens[llm.add_request(PROMPTS[0], SamplingParams(max_tokens=64, json_schema=SCHEMAS["typed-object"]))] = []
    first, late = sorted(tokens)
    assert tokens[first] == alone and tokens[late] == normal_tokens["typed-object"][0]
    llm.check_integrity()


def events(trace, kinds=("schedule", "launch", "wait", "process", "reply", "mask")) -> list[tuple[str, int]]:
    return [(e.kind, e.step) for e in trace if e.kind in kinds]


def test_the_overlap_loop_fills_a_step_s_masks_after_the_step_before_is_handled():
    """One constrained request, the overlap loop: step N+1's forward is launched before step N is waited
    for, and its `mask` (masks filled, sample queued) comes right after step N is handled; the normal loop
    fills them inside its launch and records no mask. Exactly, for the first steps."""
    params = SamplingParams(max_tokens=8, regex=r"\d{8}")
    overlap, normal = LLM(overlap=True), LLM(overlap=False)
    overlap.generate(PROMPTS[0], params)
    assert events(overlap.trace)[:16] == [
        ("schedule", 1), ("launch", 1),
        ("schedule", 2), ("launch", 2), ("wait", 1), ("process", 1), ("reply", 1), ("mask", 2),
        ("schedule", 3), ("launch", 3), ("wait", 2), ("process", 2), ("reply", 2), ("mask", 3),
        ("schedule", 4), ("launch", 4)]
    normal.generate(PROMPTS[0], params)
    assert events(normal.trace)[:10] == [(k, n) for n in (1, 2) for k in ("schedule", "launch", "wait", "process", "reply")]
    assert not [e for e in normal.trace if e.kind == "mask"]


def test_a_free_batch_puts_no_sample_off():
    """Without a constrained request the overlap loop is chapter 07's: no step puts its sample off."""
    llm = LLM(overlap=True)
    llm.generate(FREE, SamplingParams(max_tokens=8))
    assert not [e for e in llm.trace if e.kind == "mask"]


def test_with_mtp_a_constrained_verify_puts_its_accept_off():
    """With MTP the overlap loop launches step N+1's draft and verify passes before it waits for step N, and
    queues N+1's accept and draft extend once step N is handled (`mask`), as a plain step puts off its
    sample. Exactly, for the first steps; the tokens are the normal loop's without MTP."""
    params = SamplingParams(max_tokens=16, regex=r"\d{16}")
    llm = LLM(overlap=True, mtp_steps=3, hazard_check=True)
    out = llm.generate(PROMPTS[0], params)[0]
    assert events(llm.trace)[:16] == [
        ("schedule", 1), ("launch", 1),
        ("schedule", 2), ("launch", 2), ("wait", 1), ("process", 1), ("reply", 1), ("mask", 2),
        ("schedule", 3), ("launch", 3), ("wait", 2), ("process", 2), ("reply", 2), ("mask", 3),
        ("schedule", 4), ("launch", 4)]
    assert out.token_ids == LLM(overlap=False).generate(PROMPTS[0], params)[0].token_ids
    assert out.verify_steps < len(out.token_ids)


@pytest.mark.parametrize("guard", [True, False], ids=["prompt-guard", "no-prompt-guard"])
def test_a_put_off_accept_writes_its_window_after_the_fence_s_event_and_needs_the_prompt_guard(guard):
    """With MTP and a grammar the overlap loop records the fence's event when it launches the verify, and the
    window is written later, with the accept: like a plain step's put-off sample, it relies on chapter 08's
    prompt guard. One request slot: a constrained request's wasted window and the next request's longer
    prompt land in the same row of token_pool. With the guard the checker is silent; without, it names it."""
    llm = LLM(overlap=True, mtp_steps=3, hazard_check=True, guards=Guards(prompt_on_forward_stream=guard),
              max_running=1, chunked_prefill_size=-1)
    prompts, params = ["x", LONG], [SamplingParams(max_tokens=3, regex=PHONE), SamplingParams(max_tokens=4)]
    llm.processor.grammar(params[0]).compiled.result()     # compiled before the run: the request keeps its place, first
    if guard:
        assert [o.finish_reason for o in llm.generate(prompts, params)] == ["length", "length"]
        return
    with pytest.raises(HazardError, match=r"token_pool row \d+, .* and write on the forward stream \(step \d+: "
                                          r"the verify writes its accepted tokens\)"):
        llm.generate(prompts, params)


def test_regex_output_matches_whole(llm):
    for out in llm.generate(PROMPTS, SamplingParams(max_tokens=32, regex=PHONE)):
        assert re.fullmatch(PHONE, out.text) and out.finish_reason == "stop", out


def test_json_object_output_is_a_json_object(llm):
    for out in llm.generate(PROMPTS, SamplingParams(max_tokens=64, json_object=True)):
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out


@pytest.mark.parametrize("config", CONFIGS)
def test_free_requests_beside_constrained_ones_equal_a_run_without_grammars(free_tokens, config):
    """A batch mixing free requests with constrained ones (greedy and seeded sampling, one with a prompt
    chunked over several steps): the free tokens equal a run without a grammar, a seeded free request's
    equal its run alone, every constrained output is valid, and the hazard checker is silent."""
    llm = LLM(**CONFIGS[config], hazard_check=True, chunked_prefill_size=BUDGET)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    alone = llm.generate(FREE[0], sampled)[0].token_ids
    person = SamplingParams(max_tokens=64, json_schema=SCHEMAS["typed-object"])
    prompts = [FREE[0], PROMPTS[0], FREE[1], LONG, FREE[0], PROMPTS[1]]
    params = [SamplingParams(max_tokens=24), person, SamplingParams(max_tokens=24),
              SamplingParams(max_tokens=32, regex=PHONE), sampled,
              SamplingParams(max_tokens=64, temperature=0.7, seed=3, json_schema=SCHEMAS["nested"])]
    outs = llm.generate(prompts, params)
    assert [outs[0].token_ids, outs[2].token_ids] == free_tokens
    assert outs[4].token_ids == alone
    jsonschema.validate(json.loads(outs[1].text), SCHEMAS["typed-object"])
    assert re.fullmatch(PHONE, outs[3].text)
    jsonschema.validate(json.loads(outs[5].text), SCHEMAS["nested"])
    assert any(e.kind == "chunk" for e in llm.trace), "the long prompt was not chunked"
    llm.check_integrity()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_grammar_that_ends_ends_its_request(llm, ignore_eos):
    """Once the regex is matched the grammar allows only EOS; taking it ends the grammar, and the request
    ends with finish_reason "stop" long before max_tokens, even where EOS alone would not end it."""
    [out] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=100, regex=PHONE, ignore_eos=ignore_eos))
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS and re.fullmatch(PHONE, out.text)
    assert len(out.token_ids) < 100


def test_a_grammar_that_allows_no_token_fails_its_request_alone(llm, free_tokens, monkeypatch):
    """A grammar whose mask allows nothing (made so by hand: the byte-level vocabulary writes any string,
    so no schema or regex here can) ends its request with finish_reason "error"; the free requests of its
    batch finish as without it, and nothing is held."""
    monkeypatch.setattr(Grammar, "fill", lambda self, bitmask, row: bool(bitmask[row].zero_().any()))
    outs = llm.generate([FREE[0], PROMPTS[0], FREE[1]],
                        [SamplingParams(max_tokens=24), SamplingParams(regex=PHONE), SamplingParams(max_tokens=24)])
    assert (outs[1].finish_reason, outs[1].token_ids) == ("error", [])
    assert [outs[0].token_ids, outs[2].token_ids] == free_tokens
    llm.check_integrity()


def test_a_token_its_grammar_forbids_fails_its_request_alone(llm, free_tokens, monkeypatch):
    """Without the mask the model's greedy first token breaks the grammar: the request fails alone, with
    the token named in its reply, and the free requests finish as without it."""
    monkeypatch.setattr(grammar, "masked", lambda logits, bitmask: logits)
    replies = list(llm.stream([FREE[0], PROMPTS[0], FREE[1]],
                              [SamplingParams(max_tokens=24), SamplingParams(regex=PHONE), SamplingParams(max_tokens=24)]))
    [failed] = [r for r in replies if r.finish_reason == "error"]
    assert failed.token_ids == [] and re.fullmatch(r"token \d+ breaks its grammar", failed.error)
    tokens = {uid: [t for r in replies if r.uid == uid for t in r.token_ids] for uid in {r.uid for r in replies}}
    assert [tokens[failed.uid - 1], tokens[failed.uid + 1]] == free_tokens
    llm.check_integrity()


LONG_SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "nope"} for i in range(20)}}
BAD_PARAMS = [
    (dict(json_schema=42), r"json_schema must be a JSON schema \(a dict, or its JSON text\), an object, got 42"),
    (dict(json_schema="{not json"), r"json_schema must be .*its text is not JSON .*, got '\{not json'"),
    (dict(json_schema="[1, 2]"), r"json_schema must be .*an object, got '\[1, 2\]'"),
    (dict(json_schema={"type": "nope"}), r"json_schema must be .* that xgrammar compiles, got \{'type': 'nope'\}: "
                                         r"Unsupported type \"nope\"$"),
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 3}), r"json_schema .*minimum greater than maximum"),
    (dict(json_schema=LONG_SCHEMA), r"json_schema must be .*, got \{'type': 'object', .{40,60}\.\.\.: Unsupported type"),
    (dict(regex="(ab"), r"regex must be a regular expression that xgrammar compiles, got '\(ab': .*parenthesis is not closed"),
    (dict(regex=""), r"regex must be a non-empty string, a regular expression, got ''"),
    (dict(regex=5), r"regex must be a non-empty string, a regular expression, got 5"),
    (dict(json_object="yes"), r"json_object must be True or False, got 'yes'"),
    (dict(json_schema={"type": "integer"}, regex=PHONE), r"at most one grammar: .*got json_schema and regex"),
    (dict(regex=PHONE, json_object=True), r"at most one grammar: .*got regex and json_object"),
]


@pytest.mark.parametrize("options,message", BAD_PARAMS, ids=[", ".join(options) for options, _ in BAD_PARAMS])
def test_a_bad_grammar_is_refused_naming_its_field(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)
