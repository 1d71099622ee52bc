"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

# >>> ch03: sampling
import math
import numbers
import sys
# <<< ch03
# >>> ch19: a grammar's schema, as JSON text
import json
# <<< ch19
import operator
from collections.abc import Callable
from dataclasses import dataclass

# >>> ch16: the limits of the fields OpenAI's clients send
MAX_STOP = 16          # stop strings a request may give (each is searched for after every token)
MAX_LOGPROBS = 20      # the most likely tokens a request may ask for at each position (OpenAI's top_logprobs limit)
MAX_REPETITION_PENALTY = 2.0   # SGLang's limit (vLLM's before it took any number > 0)
# <<< ch16
# >>> ch03: sampling
# The smallest temperature > 0: the smallest normal float64. The sampler divides by the temperature, and a
# GPU divides by a number as a multiplication by its inverse, which is inf below this one.
MIN_TEMPERATURE = sys.float_info.min
# <<< ch03


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Checked when made, then frozen: no later assignment can slip past the checks. Every count also
    takes a NumPy integer (kept as an int); bools, floats and text are refused, naming field and value."""

    max_tokens: int = 16               # stop after this many new tokens (finish_reason "length")
    # >>> ch03: sampling
    temperature: float = 0.0           # 0: greedy; otherwise logits are divided by it before the softmax
    top_k: int = -1                    # keep only the k most likely tokens (-1: all)
    top_p: float = 1.0                 # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None            # a seeded request draws the same tokens whatever its batch
    # <<< ch03
    ignore_eos: bool = False           # keep going past an EOS token (for benchmarks)
    # >>> ch04: stop tokens
    stop_token_ids: tuple[int, ...] = ()   # more tokens that end the request (finish_reason "stop")
    # <<< ch04
    # >>> ch16: the fields OpenAI's clients send
    stop: tuple[str, ...] = ()         # stop strings: the request ends once its text holds one (finish_reason "stop")
    logprobs: int | None = None        # None: none; 0: each token's log-probability; k >= 1: and the k most likely
    min_p: float = 0.0                 # drop tokens less likely than min_p times the top one (after the temperature)
    repetition_penalty: float = 1.0    # each token of the prompt or output so far: its logit / it if > 0, else * it
    min_tokens: int = 0                # EOS and the stop tokens and strings cannot end it before this many tokens
    skip_special_tokens: bool = True   # the text leaves special tokens out (OpenAI's); False keeps them
    # <<< ch16
    # >>> ch19: grammar-constrained output (at most one of the three)
    json_schema: str | dict | None = None   # the output is JSON valid against this schema (a dict, kept as its JSON text)
    regex: str | None = None           # the output matches this regular expression, whole
    json_object: bool = False          # the output is a JSON object (OpenAI's response_format "json_object")
    # <<< ch19

    def __post_init__(self) -> None:
        checked = {"max_tokens": _integer("max_tokens", self.max_tokens, "an integer >= 1", lambda n: n >= 1)}
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        # >>> ch03: sampling
        checked |= self._checked_sampling()
        # <<< ch03
        # >>> ch04: stop tokens
        checked["stop_token_ids"] = _stop_token_ids(self.stop_token_ids)
        # <<< ch04
        # >>> ch16: stop strings and logprobs; min_p, repetition_penalty, min_tokens, skip_special_tokens
        checked |= {"stop": _stop_strings(self.stop), "logprobs": _logprobs(self.logprobs)}
        checked |= self._checked_openai_fields()
        # <<< ch16
        # >>> ch19: at most one grammar, which xgrammar compiles; a schema kept as its JSON text
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be True or False, got {self.json_object!r}")
        checked["json_schema"] = self._checked_grammar()
        # <<< ch19
        for name, value in checked.items():
            object.__setattr__(self, name, value)      # the one way to set a field of a frozen dataclass
    # >>> ch03: sampling

    def _checked_sampling(self) -> dict[str, object]:
        """temperature, top_k, top_p and seed, checked, as plain Python numbers."""
        temperature = _real("temperature", self.temperature, "a finite number", math.isfinite)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE!r}, got {self.temperature!r}")
        seed = None if self.seed is None else _integer("seed", self.seed, "an integer or None")
        if seed is not None and not -2**63 <= seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1] (what torch.Generator takes), got {self.seed!r}")
        top_k = _integer("top_k", self.top_k, "-1 (all tokens) or an integer >= 1", lambda k: k == -1 or k >= 1)
        top_p = _real("top_p", self.top_p, "in (0, 1]", lambda p: 0 < p <= 1)
        return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    # <<< ch03
    # >>> ch16: the sampling fields vLLM's and SGLang's OpenAI servers take

    def _checked_openai_fields(self) -> dict[str, object]:
        """min_p, repetition_penalty and min_tokens checked, as plain Python numbers; skip_special_tokens a bool."""
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}")
        min_p = _real("min_p", self.min_p, "in [0, 1] (0: off)", lambda p: 0 <= p <= 1)
        penalty = _real("repetition_penalty", self.repetition_penalty, f"in (0, {MAX_REPETITION_PENALTY:g}] (1: off)",
                        lambda r: 0 < r <= MAX_REPETITION_PENALTY)
        min_tokens = _integer("min_tokens", self.min_tokens, "an integer >= 0", lambda n: n >= 0)
        if min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens!r}), got {self.min_tokens!r}")
        return {"min_p": min_p, "repetition_penalty": penalty, "min_tokens": min_tokens}
    # <<< ch16
    # >>> ch19: grammar-constrained output

    def _checked_grammar(self) -> str | None:
        """At most one grammar, and one xgrammar compiles (its error becomes the ValueError): -> the
        schema as JSON text (None: none). xgrammar is imported only for a request that has a grammar."""
        given = [name for name in GRAMMARS if getattr(self, name) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"a request follows at most one grammar: json_schema, regex or json_object, "
                             f"got {' and '.join(given)}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string, a regular expression, got {_short(self.regex)}")
        schema = None if self.json_schema is None else _schema_text(self.json_schema)
        if schema is not None or self.regex is not None:
            from minioverlap.constrained.grammar import compile_error
            if (error := compile_error(schema, self.regex)) is not None:
                name = given[0]
                raise ValueError(f"{name} must be {GRAMMAR_RULES[name]} that xgrammar compiles, got "
                                 f"{_short(getattr(self, name))}: {error}")
        if given and self.min_tokens:
            raise ValueError(f"min_tokens must be 0 with a grammar ({given[0]}), got {self.min_tokens!r}: the grammar "
                             f"may end the output sooner, where it allows EOS alone, which min_tokens forbids")
        return schema

    @property
    def grammar_kind(self) -> str | None:
        """The field that gives the request's grammar ("json_schema", "regex" or "json_object"); None: none."""
        return next((name for name in GRAMMARS if getattr(self, name) not in (None, False)), None)
    # <<< ch19


def integral(value: object) -> int | None:
    """value as an int if it is an integer (an int or a NumPy integer; not a bool, a float or text), else None."""
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


def _integer(name: str, value: object, rule: str, ok: Callable[[int], bool] = lambda n: True) -> int:
    """value as an int if it is an integer and `ok` holds."""
    number = integral(value)
    if number is None or not ok(number):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return number
# >>> ch03: sampling


def _real(name: str, value: object, rule: str, ok: Callable[[float], bool]) -> float:
    """value as a float if it is a real number (not a bool) and `ok` holds (NaN fails every bound)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(float(value)):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return float(value)
# <<< ch03
# >>> ch04: stop tokens


def _stop_token_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list or tuple of token ids, got {value!r}")
    return tuple(_integer(f"stop_token_ids[{i}]", t, "an integer token id") for i, t in enumerate(value))
# <<< ch04
# >>> ch16: stop strings and logprobs


def _stop_strings(value: object) -> tuple[str, ...]:
    """A string is one stop string; a list or tuple holds up to MAX_STOP, none of them empty (an empty
    string would be found before the first token)."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of up to {MAX_STOP} strings, got {value!r}")
    if len(value) > MAX_STOP:
        raise ValueError(f"stop holds {len(value)} strings; at most {MAX_STOP} are allowed")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
    return tuple(value)


def _logprobs(value: object) -> int | None:
    if value is None:
        return None
    return _integer("logprobs", value, f"None, or an integer in [0, {MAX_LOGPROBS}] (the most likely tokens "
                    f"to return with each token's own)", lambda k: 0 <= k <= MAX_LOGPROBS)
# <<< ch16
# >>> ch19: grammar-constrained output

GRAMMARS = ("json_schema", "regex", "json_object")
GRAMMAR_RULES = {"json_schema": "a JSON schema (a dict, or its JSON text)", "regex": "a regular expression"}


def _schema_text(value: object) -> str:
    """A JSON schema as JSON text: a dict dumped, a string kept once it parses as a JSON object."""
    rule = f"json_schema must be {GRAMMAR_RULES['json_schema']}, an object"
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{rule} that JSON can write ({e}), got {_short(value)}") from None
    if not isinstance(value, str):
        raise ValueError(f"{rule}, got {_short(value)}")
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise ValueError(f"{rule}; its text is not JSON ({e}), got {_short(value)}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{rule}, got {_short(value)}")
    return value


def _short(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: a schema may be long."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
# <<< ch19
