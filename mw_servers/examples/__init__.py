"""Example middleware servers, after the AgentScope middleware docs' practical examples.

Each module runs on its own (``python -m mw_servers.examples.timing 127.0.0.1:50071``) or through
the SDK launcher, which passes constructor arguments as JSON::

    python -m agentmw.sdk mw_servers.examples.fallback:ModelFallbackMiddleware \\
        --arg fallback='"model-b"' --address 127.0.0.1:0

- ``timing``: ``TimingMiddleware`` logs each model call's time to first chunk and total time, and
  adds a ``CustomEvent("timing")`` with the reply's duration just before its ``ReplyEndEvent``.
- ``rate_limit``: ``RateLimitMiddleware`` holds model calls back with a token bucket; its slot
  counts the session's calls, how many had to wait and how long they waited.
- ``dynamic_prompt``: ``DynamicContextMiddleware`` appends the current date/time and the
  session's slot value (by default when it first saw the session) to the system prompt.
- ``fallback``: ``ModelFallbackMiddleware`` retries a failed model call on another model id; its
  slot counts the switches and keeps the last error.
"""
