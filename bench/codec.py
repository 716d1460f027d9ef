"""Event codec cost on a realistic interaction (2,048 prompt tokens, 512 response tokens with
log-probs, tool-use messages: ~31 KB of JSON in v1), codec v1 and v2 side by side. The event
is built from lists, as the gateway builds it; "re-encode" takes the event as decoded. Prints
figures; asserts nothing.

The two versions are measured in alternating rounds of the same run and each case reports the
median round, so a machine shared with other work slows both alike and the ratio holds.

    python bench/codec.py [-n ITERATIONS] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import orjson

from pipeline.events import decode, encode, load_schema
from pipeline.events.examples import interaction


def per_call(fn: Callable[[], object], n: int) -> float:
    """Seconds per call over n calls."""
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


class Held:
    """Decode as a consumer does: every value a buffer of its own (a consumer never sees the
    same bytes object twice, and 1,000 of them do not fit a CPU cache), and the events of a
    round kept alive until it ends, as a consumer keeps a batch's, so each decode writes to
    fresh memory. The plain "decode" case reuses one hot buffer and frees each event at once.
    :meth:`reset` after each round: events held across the other cases (v1's hold ~2,500
    Python ints each) would slow every case's garbage collections."""

    def __init__(self, raw: bytes, pool: int = 1000) -> None:
        self.values = [bytes(bytearray(raw)) for _ in range(pool)]
        self.held: list[object] = []
        self.i = 0

    def __call__(self) -> object:
        self.held.append(decode(self.values[self.i]))
        self.i = (self.i + 1) % len(self.values)
        return self.held[-1]

    def reset(self) -> None:
        self.held.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--iterations", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--reference-iterations",
        type=int,
        default=20,
        help="calls per round of the (slow) jsonschema reference validator",
    )
    args = parser.parse_args()
    n = args.iterations

    event = interaction(prompt_tokens=2048, response_tokens=512, text_repeat=5)
    raws = {v: encode(event, validate=True, version=v) for v in (1, 2)}
    docs = {v: orjson.loads(raw) for v, raw in raws.items()}
    decoded = {v: decode(raw) for v, raw in raws.items()}
    for raw in raws.values():
        assert decode(raw) == event

    def cases(v: int) -> list[tuple[str, Callable[[], object], int]]:
        raw, doc = raws[v], docs[v]
        out: list[tuple[str, Callable[[], object], int]] = [
            ("encode", lambda: encode(event, version=v), n),
            ("decode (parse + validate + typed event)", lambda: decode(raw), n),
            ("decode, a consumer's batch (fresh buffers, kept)", Held(raw), n),
            # The three passes the one-pass decoder replaced (orjson, the compiled schema
            # validator, the dataclass), still the path of anything it declines.
            ("decode, full path (before one pass)", lambda: decode(raw, one_pass=False), n),
            ("encode + decode", lambda: decode(encode(event, version=v)), n),
            # A decoded event holds what its version decodes to: lists from v1, packed
            # arrays from v2 (what the processors, replay and the trainer re-send).
            ("re-encode a decoded event", lambda: encode(decoded[v], version=v), n),
            ("encode(validate=True)", lambda: encode(event, validate=True, version=v), n),
            ("orjson loads only, no validation", lambda: orjson.loads(raw), n),
            ("stdlib json round trip, no checks", lambda: json.loads(json.dumps(doc)), n),
        ]
        try:
            from jsonschema import Draft7Validator

            reference = Draft7Validator(load_schema("interaction", v))
            out.append(
                ("jsonschema Draft7Validator, validate only", lambda: reference.validate(doc),
                 args.reference_iterations)
            )  # fmt: skip
        except ImportError:
            pass
        return out

    table = {v: cases(v) for v in (1, 2)}
    rounds: dict[tuple[int, str], list[float]] = {}
    started = time.perf_counter()
    for v in (1, 2):  # warm-up: compile validators, fill caches
        for _, fn, _ in table[v]:
            fn()
    for _ in range(args.rounds):
        for i in range(len(table[1])):
            for v in (1, 2):
                name, fn, iterations = table[v][i]
                rounds.setdefault((v, name), []).append(per_call(fn, iterations))
                if isinstance(fn, Held):
                    fn.reset()
    median = {k: statistics.median(v) for k, v in rounds.items()}

    size1, size2 = len(raws[1]), len(raws[2])
    print(
        f"interaction event: v1 {size1:,} bytes, v2 {size2:,} bytes ({size2 / size1:.2f}x); "
        f"median of {args.rounds} alternating rounds of {n:,} calls"
    )
    print(f"{'case':<50} {'v1 us':>9} {'v2 us':>9} {'v2/v1':>7} {'v2 events/s':>12}")
    for name, _, _ in table[1]:
        a, b = median[(1, name)], median[(2, name)]
        print(f"{name:<50} {a * 1e6:>9.1f} {b * 1e6:>9.1f} {b / a:>7.2f} {1 / b:>12,.0f}")
    one = {v: median[(v, "decode (parse + validate + typed event)")] for v in (1, 2)}
    three = {v: median[(v, "decode, full path (before one pass)")] for v in (1, 2)}
    print(
        "one-pass decode / full path: "
        f"v1 {one[1] / three[1]:.2f}x, v2 {one[2] / three[2]:.2f}x (target: v2 decode <= 30 us)"
    )
    ours = {v: median[(v, "encode + decode")] for v in (1, 2)}
    stdlib = median[(1, "stdlib json round trip, no checks")]
    print(
        "stdlib json round trip of the v1 dict (no validation) / encode + decode: "
        f"v1 {stdlib / ours[1]:.2f}x, v2 {stdlib / ours[2]:.2f}x"
    )
    print(f"time spent: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
