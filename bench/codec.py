"""The codec's cost on the messages that matter most: a model call's kwargs (what every on_model_call
Begin carries) and one streamed text delta (what every intercepted item costs on each side).
``python -m bench.codec`` prints the minimum of 7 x 2,000 runs of each (the figures of the codec
rows in bench/optimizations.py)."""

from __future__ import annotations

import asyncio
import timeit
from typing import Any

from agentmw.codec import codec
from agentmw.data import TextBlockDeltaEvent, UserMsg
from agentmw.hooks import HOOKS
from agentmw.middleware import MiddlewareBase
from agentmw.v1 import events_pb2, hooks_pb2
from agentmw.wire import decode_kwargs, encode_kwargs

from .scenarios import make_agent, tool_round_script


class _Capture(MiddlewareBase):
    """Keeps the kwargs of the reply's last model call (3 tool rounds in)."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    async def on_model_call(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any:
        self.kwargs = dict(input_kwargs)
        return await next_handler()


async def measure(number: int = 2000, repeat: int = 7) -> dict[str, float]:
    """Microseconds per operation, the minimum over ``repeat`` runs of ``number``."""
    capture = _Capture()
    async for _ in make_agent([capture], tool_round_script()).reply_stream(UserMsg("hi")):
        pass
    spec, kwargs = HOOKS["on_model_call"], capture.kwargs
    encoded = encode_kwargs(spec, kwargs, hooks_pb2.Kwargs())
    delta = TextBlockDeltaEvent(reply_id="r", block_id="b", delta="hello ")
    item = codec.encode_item(delta)
    cases = {
        "encode on_model_call kwargs": lambda: encode_kwargs(spec, kwargs, hooks_pb2.Kwargs()),
        "decode the same kwargs": lambda: decode_kwargs(spec, encoded, complete=True),
        "encode one text delta item": lambda: codec.encode_item(delta, events_pb2.Item()),
        "decode one text delta item": lambda: codec.decode_item(item),
    }
    return {name: min(timeit.repeat(op, number=number, repeat=repeat)) / number * 1e6 for name, op in cases.items()}


def main() -> None:
    for name, micros in asyncio.run(measure()).items():
        print(f"{name}: {micros:.2f} µs")


if __name__ == "__main__":
    main()
