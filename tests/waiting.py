"""What tests that watch other processes share: wait for a condition, bounded."""
import time


def wait_until(condition, deadline_s: float, what: str) -> float:
    """Poll `condition` every 50 ms; the seconds it took. Fails after `deadline_s`: a guard against a hang, not a
    timing claim."""
    started = time.perf_counter()
    while not condition():
        assert time.perf_counter() - started < deadline_s, \
            f"{what} not within {deadline_s} s (a guard against a hang, not a timing claim)"
        time.sleep(0.05)
    return time.perf_counter() - started
