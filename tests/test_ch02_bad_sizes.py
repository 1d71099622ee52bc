"""Chapter 02: the paged pool's sizes. A bool is not a size, and a size whose KV pool and request tables
could never fit the device is refused with a ValueError naming the field and the memory it would need,
before torch tries (which failed as MemoryError or OverflowError, naming nothing)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import GREEDY, PROBE, assert_as_fresh, probe_tokens
from minioverlap import LLM

HUGE = 2**62


@pytest.fixture(scope="module")
def engine() -> tuple[LLM, list[list[int]]]:
    """One engine for the module, and its greedy tokens while it is fresh."""
    llm = LLM(model="tiny", page_size=4)
    return llm, probe_tokens(llm)



@pytest.mark.parametrize("kwargs, message", [
    (dict(page_size=True), r"page_size must be an integer >= 1, got True"),
    (dict(num_pages=True), r"num_pages must be an integer >= 2, got True"),
    (dict(page_size=4.0), r"page_size must be an integer >= 1, got 4\.0"),
    (dict(num_pages=HUGE), rf"num_pages={HUGE}, .* need .* GiB, more than .* \(.* GiB\): the KV pool is .* GiB"),
    (dict(num_pages=np.int64(HUGE)), rf"num_pages={HUGE}, .* need .* GiB, more than"),
    (dict(page_size=HUGE), rf"page_size={HUGE} .* need .* GiB, more than .* \(.* GiB\): the KV pool is .* GiB"),
    # >>> ch03: many request slots
    (dict(max_running=True), r"max_running must be an integer >= 1, got True"),
    (dict(max_running=HUGE), rf"max_running={HUGE} need .* GiB, more than .*the request tables .* = .* GiB"),
    # <<< ch03
])
def test_a_bad_or_impossible_size_is_refused_naming_field_and_memory(engine, kwargs, message):
    """A ValueError, never a MemoryError or OverflowError; the engine already running is untouched."""
    llm, fresh = engine
    with pytest.raises(ValueError, match=message):
        LLM(model="tiny", **kwargs)
    assert_as_fresh(llm, fresh)


def test_numpy_integer_sizes_are_sizes(engine):
    """NumPy sizes build the same engine as plain ints: it gives the same tokens."""
    llm, fresh = engine
    other = LLM(model="tiny", page_size=np.int64(4), num_pages=np.int32(200))
    assert [o.token_ids for o in other.generate(PROBE, GREEDY)] == fresh
