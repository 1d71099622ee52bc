"""Chapter 11: KV slots reserved two windows past the host's count.

    python examples/ch11_two_windows.py

First it replays Figure 7 of the overlap article (one request, k = 3, the host counting 100) with the
engine's own `reservation_end` and the overlap loop's lag: step n is built when the host has handled
step n-2 only, while the device starts step n where step n-1 left the request. Then it runs the tiny
model in the normal loop, records what the host counted and reserved at each verify step, and replays
that run's accept lengths under the same lag.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from minioverlap import LLM, SamplingParams
from minioverlap.engine.forward_batch import ForwardMode
from minioverlap.speculative.verify_batch import reservation_end, window_slack

K = 3
W = K + 1                                          # a verify window: the bonus token and k drafts


def replay(start: int, accepts: list[int]) -> list[tuple[int, int, int, int, int]]:
    """Each step under the overlap loop's lag: (host's count, last reserved position, window's first and
    last position, accepted). The host's count is the length after the step before last; the device
    starts each window at the true length, after the step before."""
    lengths, end, rows = [start], 0, []            # lengths[n]: the true length after step n
    for n, accepted in enumerate(accepts, start=1):
        count = lengths[max(n - 2, 0)]
        end = reservation_end(count, end, W)       # exclusive: positions count .. end-1 have a KV slot
        first = lengths[n - 1]
        rows.append((count, end - 1, first, first + K, accepted))
        lengths.append(first + accepted)
    return rows


def replay_table(title: str, rows: list[tuple[int, int, int, int, int]]) -> Table:
    table = Table("step", "host's count", "reserved up to", "window", "accepted", "to spare", title=title,
                  caption="reserved up to: the last position with a KV slot; to spare: reserved past the window")
    for n, (count, last_reserved, first, last, accepted) in enumerate(rows, start=1):
        table.add_row(str(n), str(count), str(last_reserved), f"{first}-{last}", str(accepted),
                      str(last_reserved - last))
    return table


def run_one(llm: LLM, prompt: str, params: SamplingParams) -> tuple[int, list[tuple[int, int, int, int]]]:
    """The normal loop, one iteration at a time (Scheduler.normal_loop opened up), looking at the
    request right after each verify step is built: (count, reserved end, pages held, accepted)."""
    sched, (req,) = llm.scheduler, llm.make_requests(prompt, params)
    sched.add_request(req)
    steps = []
    while sched.busy:
        sched.receive()
        out = sched.launch(sched.schedule())
        seen = (req.seq_len, req.kv_len, len(req.pages))     # the host's view of the step it just built
        sched.wait(out)
        sched.process(out)
        if out.batch.mode is ForwardMode.TARGET_VERIFY:
            steps.append((*seen, req.seq_len - seen[0]))    # seq_len moved by what the step accepted
    return len(req.prompt_ids), steps


def main() -> None:
    console = Console()
    worst = []                                     # every window's spare positions, both replays

    console.rule("Figure 7: the host counts 100, k = 3, the overlap loop's lag")
    figure = replay(100, [3, 4, 1, 2])
    console.print(replay_table("one request, four steps", figure))
    spare = [last_reserved - last for _, last_reserved, _, last, _ in figure]
    worst += spare
    console.print(f"every window ends at or below the last reserved position: {min(spare) >= 0}")
    console.print(f"worst case: {min(spare)} to spare, at step {spare.index(min(spare)) + 1}, "
                  "after a step that accepted a whole window")

    prompt, tokens = "def fibonacci(n):", 48
    console.rule(f"a real run: {prompt!r}, max_tokens={tokens}, k = {K}, the normal loop")
    llm = LLM(model="tiny", overlap=False, mtp_steps=K)
    pages_for = llm.runner.allocator.pages_for
    P, steps = run_one(llm, prompt, SamplingParams(max_tokens=tokens))
    table = Table("step", "host's count", "reserved up to", "window", "accepted", "pages", "1 window",
                  caption="pages: held once the step is built; 1 window: what chapter 09 held")
    for n, (count, kv_len, pages, accepted) in enumerate(steps, start=1):
        table.add_row(str(n), str(count), str(kv_len - 1), f"{count}-{count + K}", str(accepted), str(pages),
                      str(pages_for(count + W)))
    console.print(table)
    held = max(s[2] for s in steps)
    console.print(f"pages held at most: {held} with two windows, {pages_for(steps[-1][0] + W)} with one "
                  f"(page_size {llm.runner.allocator.page_size})")
    console.print(f"admission promised pages_for({P} + {tokens} - 1 + {window_slack(K)}) = "
                  f"{pages_for(P + tokens - 1 + window_slack(K))}")
    normal = min(kv_len - 1 - (count + K) for count, kv_len, _, _ in steps)
    console.print(f"normal loop: the count is exact, {normal} to spare, the second window never written")

    lagged = replay(P, [s[3] for s in steps])
    spare = [last_reserved - last for _, last_reserved, _, last, _ in lagged]
    worst += spare
    console.print("the same accept lengths under the overlap loop's lag, to spare per step:")
    console.print(f"{spare}")
    full = [n for n, s in enumerate(steps[:-1], start=2) if s[3] == W]
    console.print(f"0 to spare right after a step that accepted all {W}: steps {full}")

    llm.check_integrity()
    assert min(worst) >= 0
    console.print(f"every window ended within the reservation (worst case: {min(worst)} positions to spare)")


if __name__ == "__main__":
    main()
