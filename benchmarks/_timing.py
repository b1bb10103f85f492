"""The interleaved timing the benchmarks share."""

import statistics
import time


def calls_per_sample(runners, seconds, warmups=2):
    """How many calls one timed sample of `interleaved` makes, the same for
    every runner: enough for the slowest runner's sample to last about
    `seconds` (a single 30 ms step is at the mercy of the host's hiccups; a
    sample of several is not). Calls each runner `warmups` times
    (compilation), then once timed."""
    slowest = 0.0
    for run in runners.values():
        for _ in range(warmups):
            run()
        start = time.perf_counter()
        run()
        slowest = max(slowest, time.perf_counter() - start)
    return max(1, round(seconds / slowest))


def interleaved(runners, repeats, warmups=2, calls=1):
    """Calls each of `runners` (name -> no-argument call that returns when
    its work is done) `warmups` times (compilation), then times them in turn,
    A B C A B C ..., for `repeats` rounds, each sample `calls` calls: the
    median seconds a call of each."""
    for run in runners.values():
        for _ in range(warmups):
            run()
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}
