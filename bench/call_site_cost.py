"""The cost of the call-site check per collective (python/common/call_sites.h): the time
CallSites.mark() takes to walk the caller's Python stack, hash it, count it and format the
text, at several stack depths, against an empty Python call in the same run.

    PYTHONPATH=build/python python3 bench/call_site_cost.py [--calls 200000]

Prints one line per depth: microseconds per mark() and per empty call, and their difference.
mark() is what every collective of the Python SDK and of the c10d backend pays (the c10d
backend also takes the GIL back for it: torch's bindings release it before calling the
backend; that adds one uncontended PyGILState_Ensure/Release, measured as "c10d" below with
torch importable).
"""
import argparse
import time

from collserve import _collserve


def nested(depth, fn):
    if depth == 0:
        return fn()
    return nested(depth - 1, fn)


def per_call(fn, calls, depth):
    def loop():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - t0
    best = min(nested(depth, loop) for _ in range(5))
    return best / calls * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200000)
    a = p.parse_args()
    sites = _collserve.CallSites()
    print("depth  mark() us  empty call us  mark() - empty us")
    for depth in (1, 8, 16, 32, 64):
        m = per_call(sites.mark, a.calls, depth)
        e = per_call(lambda: None, a.calls, depth)
        print(f"{depth:>5}  {m:>9.3f}  {e:>13.3f}  {m - e:>17.3f}")
    _collserve.set_call_site("")


if __name__ == "__main__":
    main()
