# >>> ch08 file: exercise 08.2, race or no race
"""Exercise 08.2: race or no race?

Each scenario below is a short history of accesses to the shared tables, in the order the host queued
them, with the events that order them. For each, decide whether the hazard checker of chapter 08 raises
`HazardError`: two accesses to the same element, at least one a write, with no happens-before between
them, is a race. Write your answers into ANSWERS, then run the judge:

    python practice/judge.py start 08.2
    python practice/judge.py test 08.2

The operations:
    ("access", stream, "read" | "write", table, row, start, stop)   positions start .. stop-1 of a row
    ("record", stream, name)          an event recorded on the stream (everything queued there so far)
    ("wait", stream, name)            the stream waits for the event
    ("wait_stream", stream, other)    the stream waits for everything queued on `other` so far
    ("host_wait", name)               the host blocks until the event has happened

The judge replays each history on the checker itself and compares.
"""

from __future__ import annotations

SCENARIOS: dict[int, tuple[str, list[tuple]]] = {
    1: ("The scheduler appends the next KV slot to a row that the running step reads", [
        ("access", "forward", "read", "req_to_token", 2, 0, 10),
        ("access", "schedule", "write", "req_to_token", 2, 10, 11)]),
    2: ("A new request takes the row of a finished one while a step still reads it; no fence", [
        ("access", "forward", "read", "req_to_token", 2, 0, 10),
        ("access", "schedule", "write", "req_to_token", 2, 0, 4)]),
    3: ("The same, behind the fence", [
        ("access", "forward", "read", "req_to_token", 2, 0, 10),
        ("record", "forward", "shared_read_done"),
        ("wait", "schedule", "shared_read_done"),
        ("access", "schedule", "write", "req_to_token", 2, 0, 4)]),
    4: ("Behind the fence, the scheduler writes a new prompt into token_pool; the step's sampler writes there after its reads", [
        ("access", "forward", "read", "token_pool", 2, 9, 10),
        ("record", "forward", "shared_read_done"),
        ("access", "forward", "write", "token_pool", 2, 10, 11),
        ("wait", "schedule", "shared_read_done"),
        ("access", "schedule", "write", "token_pool", 2, 0, 16)]),
    5: ("The normal loop: the host waits for the step's copy-done event before the scheduler writes", [
        ("access", "forward", "write", "token_pool", 2, 10, 11),
        ("record", "forward", "copy_done"),
        ("host_wait", "copy_done"),
        ("access", "schedule", "write", "token_pool", 2, 0, 16)]),
    6: ("Step N's sampler writes a token that step N+1 reads as its input", [
        ("access", "forward", "write", "token_pool", 3, 5, 6),
        ("access", "forward", "read", "token_pool", 3, 5, 6)]),
    7: ("The scheduler writes a row's KV slots; the step launched next reads them", [
        ("access", "schedule", "write", "req_to_token", 4, 0, 8),
        ("wait_stream", "forward", "schedule"),
        ("access", "forward", "read", "req_to_token", 4, 0, 8)]),
    8: ("Step N+1 is launched and reads its input token; then the host writes that token from step N's result", [
        ("access", "forward", "read", "token_pool", 1, 6, 7),
        ("access", "schedule", "write", "token_pool", 1, 6, 7)]),
    9: ("The scheduler and a running step both read the same row", [
        ("access", "forward", "read", "req_to_token", 1, 0, 5),
        ("access", "schedule", "read", "req_to_token", 1, 0, 5)]),
    10: ("The host waits for an event recorded before the step's sampler, then the scheduler writes", [
        ("record", "forward", "early"),
        ("access", "forward", "write", "token_pool", 2, 10, 11),
        ("host_wait", "early"),
        ("access", "schedule", "write", "token_pool", 2, 0, 16)]),
}

# >>> exercise 08.2: race or no race
ANSWERS: dict[int, str] = {    # scenario -> "race" or "no race"
    1: "no race",    # different elements: position 10 is not one the step reads
    2: "race",       # write-after-read with nothing between the streams
    3: "no race",    # the schedule stream waits for the step's reads
    4: "race",       # the fence opens before the sampler's write: write-after-write in no order
    5: "no race",    # the host saw the write finish; what it queues afterwards follows it
    6: "no race",    # one stream: stream order
    7: "no race",    # the forward stream waits for the schedule stream before the step
    8: "race",       # the read was queued first, on another stream: write-after-read in no order
    9: "no race",    # two reads never race
    10: "race",      # the event was recorded before the write, so waiting for it says nothing about the write
}
# <<< exercise 08.2
