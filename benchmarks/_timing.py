"""The interleaved timing the benchmarks share."""

import statistics
import time


def interleaved(runners, repeats, warmups=2):
    """Calls each of `runners` (name -> no-argument call that returns when
    its work is done) `warmups` times (compilation), then times them in turn,
    A B C A B C ..., for `repeats` rounds: the median seconds of each."""
    for run in runners.values():
        for _ in range(warmups):
            run()
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
