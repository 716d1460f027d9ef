"""Event codec throughput on a realistic interaction (2,048 prompt tokens, 512 response tokens
with log-probs, tool-use messages: ~31 KB of JSON). Prints figures; asserts nothing.

    python bench/codec.py [-n ITERATIONS]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable

import orjson

from pipeline.events import decode, encode, load_schema
from pipeline.events.examples import interaction


def measure(fn: Callable[[], object], n: int) -> float:
    """Seconds per call over n calls, after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--iterations", type=int, default=2000)
    parser.add_argument(
        "--reference-iterations",
        type=int,
        default=100,
        help="iterations for the (slow) jsonschema reference validator",
    )
    args = parser.parse_args()
    n = args.iterations

    event = interaction(prompt_tokens=2048, response_tokens=512, text_repeat=5)
    raw = encode(event, validate=True)
    size = len(raw)
    assert decode(raw) == event

    doc = orjson.loads(raw)

    cases: list[tuple[str, Callable[[], object], int]] = [
        ("orjson encode only", lambda: encode(event), n),
        ("decode (orjson + fastjsonschema + dataclass)", lambda: decode(raw), n),
        ("encode + validate + decode", lambda: decode(encode(event)), n),
        ("orjson round trip, no validation", lambda: orjson.loads(orjson.dumps(event)), n),
        ("stdlib json round trip (dict), no validation", lambda: json.loads(json.dumps(doc)), n),
        (
            "stdlib json round trip incl. dataclasses.asdict",
            lambda: json.loads(json.dumps(dataclasses.asdict(event))),
            n,
        ),
    ]
    try:
        from jsonschema import Draft7Validator

        reference = Draft7Validator(load_schema("interaction"))
        cases.append(
            (
                "jsonschema Draft7Validator, validate only",
                lambda: reference.validate(doc),
                args.reference_iterations,
            )
        )
    except ImportError:
        pass

    print(f"interaction event: {size:,} bytes of JSON; {n:,} iterations per case")
    print(f"{'case':<46} {'us/event':>10} {'events/s':>11} {'MB/s':>8}")
    started = time.perf_counter()
    results: dict[str, float] = {}
    for name, fn, iterations in cases:
        per = measure(fn, iterations)
        results[name] = per
        print(f"{name:<46} {per * 1e6:>10.1f} {1 / per:>11,.0f} {size / per / 1e6:>8.1f}")
    ours = results["encode + validate + decode"]
    stdlib = results["stdlib json round trip (dict), no validation"]
    print(
        f"stdlib json round trip (no validation) / encode + validate + decode: {stdlib / ours:.2f}x"
    )
    print(f"time spent: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
