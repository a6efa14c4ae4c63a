"""The tracing server (mw_servers.tracing) attached remotely vs no middleware, on the whole-reply
scenario (3 tool rounds, then 1,000 text deltas). Part of ``make bench``; run alone:

    python -m bench.tracing [--rounds 15]

The tracing server exports over OTLP to a receiver in a process of its own, so it does its real
span work; the host (this process) does not trace, which isolates what the attached tracer costs
the agent. For context, the same TracingMiddleware also runs in-process, in a host process of its
own that exports to the same receiver. See bench/builtins.py.
"""

from .builtins import main

if __name__ == "__main__":
    main("tracing", __doc__)
