# >>> ch08 file: the stream hazard checker
"""The stream hazard checker: races between streams, found on any CPU, deterministically.

On a GPU the schedule stream and the forward stream run independently; only events order them. A
write on one stream and an access to the same element on the other, with no event between them, is a
race: which one lands first depends on how busy the GPU is, and the result is flaky at best. On a CPU
everything runs in program order, so such a race never shows as a wrong token. The checker makes it
visible anyway: it records every access to a shared table as (table, elements, read or write,
stream, site) and keeps, per stream, a vector clock of what that stream is known to come after:

    an access on stream s           ticks s's own entry; the access is stamped with that tick
    an event recorded on s          is a copy of s's clock
    s waits for an event            s's clock takes the larger entry of the two, entry by entry
    s waits for stream t            the same, with t's clock now
    the host waits for an event     the host's clock takes the event's (a host sync)
    the host queues work on s       s's clock takes the host's: what the host has seen finish, s follows

Access A happens before access B (on stream b) if A's stamp is at most b's clock entry for A's
stream. Two accesses to the same element, at least one a write, neither before the other: HazardError,
naming the table, the elements and both sites. Elements are fine-grained on purpose: (row, position)
for req_to_token and token_pool, a KV slot for the KV pool. The scheduler appends slot numbers to a
row whose earlier positions the running step reads, and that is no race.

References: vector clocks (Fidge 1988, Mattern 1988); FastTrack (Flanagan and Freund, 2009) for
keeping one write and one read per thread (here: per stream) for each element.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

STREAMS = ("host", "schedule", "forward")
Clock = dict[str, int]


class HazardError(RuntimeError):
    """Two accesses to the same elements of a shared table, at least one a write, in no order."""


@dataclass(frozen=True)
class Access:
    kind: str          # "read" or "write"
    stream: str        # one of STREAMS
    tick: int          # the stream's own clock entry when it made the access
    site: str          # where in the engine, for the report


@dataclass
class Cell:
    """One element's history: its last write, and the last read of each stream since then."""
    write: Access | None = None
    reads: dict[str, Access] = field(default_factory=dict)


class HazardChecker:
    def __init__(self) -> None:
        self.clocks: dict[str, Clock] = {s: {t: 0 for t in STREAMS} for s in STREAMS}
        self.current = "host"                       # the stream that the engine's work goes to now
        self.cells: dict[tuple[str, object], Cell] = {}
        self.host_waits: list[str] = []             # the site of every host sync, in order
        self.step = 0                               # the step being scheduled or run, for the reports

    # ---- ordering
    def _tick(self, stream: str) -> int:
        clock = self.clocks[stream]
        if stream != "host":                        # queued by the host: after all the host has seen
            join(clock, self.clocks["host"])
        clock[stream] += 1
        return clock[stream]

    def record(self, stream: str | None = None) -> Clock:
        """An event recorded on the current stream (or `stream`): everything queued there so far."""
        stream = stream or self.current
        self._tick(stream)
        return dict(self.clocks[stream])

    def wait_event(self, event: Clock) -> None:
        """The current stream waits for the event (on a GPU: stream.wait_event)."""
        join(self.clocks[self.current], event)

    def wait_stream(self, other: str) -> None:
        """The current stream waits for all that `other` has queued so far (stream.wait_stream)."""
        join(self.clocks[self.current], self.record(other))

    def host_wait(self, event: Clock, site: str) -> None:
        """The host blocks until the event has happened (event.synchronize())."""
        join(self.clocks["host"], event)
        self.host_waits.append(site)

    def ordered_before(self, a: Access, stream: str) -> bool:
        return a.tick <= self.clocks[stream][a.stream]

    # ---- accesses
    def access(self, table: str, elements: Iterable, kind: str, site: str) -> None:
        """Record that the current stream reads or writes these elements of the table; raise on a race."""
        stream, site = self.current, f"step {self.step}: {site}"
        now = Access(kind, stream, self._tick(stream), site)
        races: dict[Access, list] = {}
        for element in elements:
            cell = self.cells.setdefault((table, element), Cell())
            earlier = [cell.write] if kind == "read" else [cell.write, *cell.reads.values()]
            for a in earlier:
                if a is not None and not self.ordered_before(a, stream):
                    races.setdefault(a, []).append(element)
            if kind == "write":
                cell.write, cell.reads = now, {}
            else:
                cell.reads[stream] = now
        if races:
            a, where = next(iter(races.items()))
            raise HazardError(f"{table} {describe(where)}: {kind} on the {stream} stream ({site}) and "
                              f"{a.kind} on the {a.stream} stream ({a.site}) are in no order: "
                              f"either may happen first")


def join(clock: Clock, other: Clock) -> None:
    for stream, tick in other.items():
        clock[stream] = max(clock[stream], tick)


def describe(elements: list) -> str:
    """[(3, 5), (3, 6), (3, 7)] -> 'row 3, positions 5..7'; [17, 18] -> 'KV slots 17..18'."""
    if not isinstance(elements[0], tuple):
        return "KV slots " + spans(sorted(elements))
    rows: dict[int, list[int]] = {}
    for row, pos in elements:
        rows.setdefault(row, []).append(pos)
    return "; ".join(f"row {row}, position{'s' if len(p) > 1 else ''} {spans(sorted(p))}" for row, p in sorted(rows.items()))


def spans(values: list[int]) -> str:
    """[1, 2, 3, 7] -> '1..3, 7'"""
    out, start = [], values[0]
    for prev, v in zip(values, values[1:] + [None]):
        if v is None or v != prev + 1:
            out.append(f"{start}..{prev}" if prev != start else str(start))
            start = v
    return ", ".join(out)
