"""A test middleware that "speaks": after each text block of a reply it streams a short WAV tone.

Served in its own process by the SDK launcher::

    python -m agentmw.sdk tests.audio_mw:Beep --address 127.0.0.1:0

Its ``on_reply`` intercepts only ``TextBlockEndEvent``; after passing each one on it yields a
``DataBlockStartEvent``, the base64 of ``tone()`` in ``PIECES`` ``DataBlockDeltaEvent``s, and a
``DataBlockEndEvent`` (media type ``audio/wav``), as a TTS middleware would.
"""

from __future__ import annotations

import base64
import io
import math
import struct
import wave
from collections.abc import AsyncIterator
from typing import Any

from agentmw.sdk import (
    DataBlockDeltaEvent,
    DataBlockEndEvent,
    DataBlockStartEvent,
    MiddlewareBase,
    TextBlockEndEvent,
    new_id,
    subscribe,
)

RATE = 8000
SECONDS = 0.1
FREQUENCY = 440.0
PIECES = 3
MEDIA_TYPE = "audio/wav"


def tone() -> bytes:
    """A 0.1 s 440 Hz mono 16-bit PCM WAV file, as bytes."""
    frames = int(RATE * SECONDS)
    pcm = b"".join(
        struct.pack("<h", round(12000 * math.sin(2 * math.pi * FREQUENCY * i / RATE))) for i in range(frames)
    )
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)
    return out.getvalue()


def pieces(data: bytes, n: int = PIECES) -> list[str]:
    """``data`` base64-encoded in ``n`` pieces, each valid base64 on its own (split on 3-byte bounds)."""
    step = -(-len(data) // n)
    step += -step % 3
    return [base64.b64encode(data[i : i + step]).decode() for i in range(0, len(data), step)]


class Beep(MiddlewareBase):
    subscriptions = {"on_reply": subscribe(intercept=[TextBlockEndEvent])}

    async def get_middleware_key(self) -> str:
        return "beep"

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> AsyncIterator[Any]:
        async for event in next_handler(**input_kwargs):
            yield event
            if isinstance(event, TextBlockEndEvent):
                block_id = new_id()
                reply_id = event.reply_id
                yield DataBlockStartEvent(reply_id=reply_id, block_id=block_id, media_type=MEDIA_TYPE, name="beep")
                for piece in pieces(tone()):
                    yield DataBlockDeltaEvent(reply_id=reply_id, block_id=block_id, media_type=MEDIA_TYPE, data=piece)
                yield DataBlockEndEvent(reply_id=reply_id, block_id=block_id)
