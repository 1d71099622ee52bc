# >>> ch19 file: a request's grammar
"""A request's grammar: the tokens it may take next, as a mask over the vocabulary.

A request with a json_schema, a regex or json_object follows a grammar that xgrammar (the default
backend of SGLang and vLLM) compiles against the engine's vocabulary: in every state of the grammar,
which tokens may come next. Three pieces:

    GrammarBackend   one per engine: the vocabulary as xgrammar reads it (its TokenizerInfo, built once)
                     and a GrammarCompiler, run in a thread of its own (the scheduler never waits for a
                     compile), with a future per grammar (the same schema compiles once)
    Grammar          one per request: its compile's future, then, once the compile is done and the
                     scheduler moves the request from its grammar queue (start), a GrammarMatcher over
                     the compiled grammar. It fills the request's row of a token bitmask (or a verify
                     window's rows, walking along the drafts and back), accepts each token the request
                     takes, and says when it has terminated (it took a stop token where the grammar may end)
    token_bitmask    a step's mask on the host: a row per request, ceil(vocab / 32) int32 words, bit t of
                     a row set if token t is allowed; a free request's row is all ones. `masked` makes a
                     copy of the logits with each forbidden token's logit -inf, on the logits' device

The mask of a request depends on every token it has taken, so it is filled on the host once the step
before has been handled: in the normal loop when the step is launched; in the overlap loop, where the
next step is launched first, its sample is put off until then (GrammarManager.puts_off).

JSON schemas compile to the compact form, one line with json.dumps's separators (", ", ": "), and no
whitespace elsewhere: a grammar that allowed any whitespace would let a small model's greedy output
run on in spaces and newlines instead of ending.

xgrammar imports transformers (half a second), which an engine without a grammar never needs: this
module is imported where a grammar first is.
"""

from __future__ import annotations

import re
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

COMPACT = dict(any_whitespace=False)   # JSON on one line, as json.dumps writes it
JSON_OBJECT = '{"type": "object"}'     # json_object: any JSON object (vLLM compiles the same schema for it)


def compile_error(schema: str | None, regex: str | None) -> str | None:
    """xgrammar's complaint about a JSON schema (as JSON text) or a regex, or None if it compiles. The
    grammar alone, without a vocabulary: the check SamplingParams makes when it is built."""
    try:
        if schema is not None:
            xgr.Grammar.from_json_schema(schema, **COMPACT)
        else:
            xgr.Grammar.from_regex(regex)
    except RuntimeError as e:          # what xgrammar raises for a schema or regex it cannot compile
        return complaint(e)
    return None


def complaint(error: RuntimeError) -> str:
    """xgrammar's message, without its time and C++ source line."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error)).strip()


class GrammarBackend:
    """The engine's grammar compiler, over its vocabulary, in a thread of its own (SGLang's grammar backend
    compiles in a ThreadPoolExecutor too): a request's grammar is compiled while the scheduler runs the
    other requests' steps, and the request waits in the scheduler's grammar queue until it is done."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        """vocab_size is the model's (its logits' width), which may exceed the tokenizer's: the tokens past
        the tokenizer's are never allowed. A grammar ends with one of stop_token_ids (the model's EOS)."""
        self.vocab = (tokenizer, vocab_size, stop_token_ids)
        self.compiler: xgr.GrammarCompiler | None = None        # made by the thread, at its first compile
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.futures: dict[tuple[str, str | None], Future] = {}  # (kind, source) -> its compile

    def grammar(self, kind: str, source: str | None) -> Grammar:
        """A request's grammar, given as SamplingParams gives it: kind "json_schema" (source: the schema as
        JSON text), "regex" (source: the regex) or "json_object" (no source). At once: its compile is
        queued on the thread, or, for a grammar asked for before, is the one queued then."""
        key = (kind, source)
        if key not in self.futures:
            self.futures[key] = self.thread.submit(self.compile, kind, source)
        return Grammar(kind, self.futures[key])

    def compile(self, kind: str, source: str | None) -> xgr.CompiledGrammar:
        """In the thread: the grammar compiled against the vocabulary (xgrammar's RuntimeError if it cannot
        be). The first compile builds the vocabulary as xgrammar reads it (its TokenizerInfo)."""
        if self.compiler is None:
            tokenizer, vocab_size, stop_token_ids = self.vocab
            info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                                      vocab_size=vocab_size, stop_token_ids=stop_token_ids)
            self.compiler = xgr.GrammarCompiler(info)
        if kind == "regex":
            return self.compiler.compile_regex(source)
        return self.compiler.compile_json_schema(source if kind == "json_schema" else JSON_OBJECT, **COMPACT)


class Grammar:
    """A request's grammar, in the state its tokens so far have left it in."""

    def __init__(self, kind: str, compiled: Future) -> None:
        self.kind = kind                         # SamplingParams' field that asked for it
        self.compiled = compiled                 # its compile, in the backend's thread
        self.matcher: xgr.GrammarMatcher | None = None   # made when the request is admitted (start)

    def ready(self) -> bool:
        """Whether its compile is done (or has failed): a poll, which never waits."""
        return self.compiled.done()

    def start(self) -> None:
        """Its matcher, at the grammar's start, once the request is admitted. It waits for the compile if that
        is not done (a following rank's, chapter 20: rank 0's is). A grammar that did not compile against
        the vocabulary: ValueError naming the field, with xgrammar's complaint."""
        try:
            self.matcher = xgr.GrammarMatcher(self.compiled.result())
        except RuntimeError as e:
            raise ValueError(f"{self.kind} did not compile against the vocabulary: {complaint(e)}") from None

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Its row of the bitmask: the tokens it may take next. False if it allows none."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return bool(bitmask[row].any())

    def fill_window(self, bitmask: torch.Tensor, drafts: list[int]) -> None:
        """A verify window's rows of the bitmask (k+1 rows for k drafts): row j the tokens it may take after
        drafts d1..dj, found by walking the matcher along the drafts; then back, to where it was: the
        scheduler advances it when the step is handled, by the tokens accepted. After a draft its grammar
        forbids, or one that ends it (its stop token), the rows stay all ones: the row before masks that draft,
        or the request ends there, so the accept rule never uses them."""
        # >>> exercise 19.1: a verify window's masks
        taken = 0
        while not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, taken)
            if taken == len(drafts) or not self.matcher.accept_token(drafts[taken]):
                break
            taken += 1
        self.matcher.rollback(taken)
        # <<< exercise 19.1

    def accept(self, token: int) -> bool:
        """Advance by a token the request took; False (and no change) if the grammar forbids it."""
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        """Whether it has taken a stop token where the grammar may end: the request is done."""
        return self.matcher.is_terminated()


def token_bitmask(grammars: list[Grammar | None], vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    """The step's mask on the host, [B, ceil(vocab_size / 32)] int32, one row per grammar: filled by it,
    or all ones for None (a free row). And the rows whose grammar allows no token: each is left all ones,
    so that its sample is an ordinary one; the caller fails that row's request alone (chapter 07)."""
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)       # all ones
    stuck = [i for i, grammar in enumerate(grammars) if grammar is not None and not grammar.fill(bitmask, i)]
    bitmask[stuck] = -1
    return bitmask, stuck


def window_bitmask(grammars: list[Grammar | None], drafts: list[list[int]], vocab_size: int) -> torch.Tensor:
    """A verify step's mask on the host, [B * W, words]: each grammar's W = k+1 rows after its row's drafts
    (Grammar.fill_window), all ones for None."""
    W = len(drafts[0]) + 1
    bitmask = xgr.allocate_token_bitmask(len(grammars) * W, vocab_size)
    for i, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill_window(bitmask[i * W:(i + 1) * W], drafts[i])
    return bitmask


def masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [..., vocab] in which each token its row of the bitmask forbids is -inf; the
    others, and every row of a free request, as they were. A copy: the step's logprobs stay the model's
    own distribution (chapter 16). On a GPU the mask goes through pinned memory, without making the host
    wait, and xgrammar's kernel applies it there."""
    out = logits.reshape(-1, logits.shape[-1]).clone()
    if out.device.type == "cuda":
        bitmask = bitmask.pin_memory().to(out.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=out.shape[-1])
    return out.view(logits.shape)
