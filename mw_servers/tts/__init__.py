"""TTSMiddleware: speech for every text block of a reply (docs/tts.md).

``python -m mw_servers.tts --address HOST:PORT [--engine espeak|piper|dashscope|dashscope-realtime]
[--voice V] [--realtime]``; in-process: ``Agent(middlewares=[TTSMiddleware(EspeakEngine())])``.

Its ``on_reply`` sees text-block events only. Standard mode: the text of a block is collected
and spoken when its ``TextBlockEndEvent`` comes, which it holds meanwhile: the end goes out at
once, then ``DataBlockStartEvent``, ``DataBlockDeltaEvent``s (incremental base64 audio) and
``DataBlockEndEvent``, streamed as the engine makes them. Realtime mode: every delta is also
pushed to the engine, audio goes out as soon as the engine returns it, between the text deltas,
and the rest after the block's end. Each text
block gets an audio block of its own id; an engine error becomes a ``CustomEvent("tts_error")``
and the text goes on untouched. Once the reply is interrupted (``agent.interrupted``, remotely as
soon as the host's notice arrives) nothing more is spoken: speech under way stops at its next
piece, its audio block is ended, and the rest of the reply's text stays silent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from agentmw.data import (
    CustomEvent,
    DataBlockDeltaEvent,
    DataBlockEndEvent,
    DataBlockStartEvent,
    TextBlockDeltaEvent,
    TextBlockEndEvent,
    new_id,
)
from agentmw.middleware import MiddlewareBase, ReplyKwargs, subscribe

from .engines import (
    ENGINES,
    DashScopeEngine,
    DashScopeRealtimeEngine,
    Engine,
    EngineError,
    EspeakEngine,
    PiperEngine,
    Utterance,
    make_engine,
)

ERROR_EVENT = "tts_error"
_END = object()  # the inner pipeline is exhausted
# Raw audio one reply may carry. The host takes at most 64 MiB of messages from one hook call (its
# max_bytes); base64 makes this ~43 MiB, leaving the rest for the text passed on. Past it, the
# speech stops with a tts_error (a ~20,000-character reply at espeak's 22 kHz), the text goes on.
MAX_REPLY_AUDIO = 32 * 1024 * 1024


@dataclass
class _Block:
    """One text block's speech: its text so far, its audio block (opened with the first chunk)."""

    reply_id: str
    text: list[str] = field(default_factory=list)
    audio_id: str = ""
    utterance: Utterance | None = None
    failed: bool = False
    spoken: list[int] = field(default_factory=lambda: [0])  # the reply's audio bytes so far (shared)


class TTSMiddleware(MiddlewareBase):
    def __init__(
        self, engine: Engine | None = None, *, realtime: bool | None = None, max_reply_audio: int = MAX_REPLY_AUDIO
    ) -> None:
        self.engine = engine if engine is not None else EspeakEngine()
        self.max_reply_audio = max_reply_audio
        self.realtime = self.engine.realtime if realtime is None else realtime
        # Text-block events only. The block end is intercepted: it must wait for the audio (so it
        # goes out before the reply moves on). Realtime audio goes out between the deltas, so
        # realtime mode intercepts them too; standard mode only reads them (observed copies).
        # run_ahead: speaking a block after its end's yield need not wait for the consumer's next ask.
        if self.realtime:
            sub = subscribe(intercept=[TextBlockDeltaEvent, TextBlockEndEvent], eager_next=True, run_ahead=True)
        else:
            sub = subscribe(
                observe=[TextBlockDeltaEvent], intercept=[TextBlockEndEvent], eager_next=True, run_ahead=True
            )
        self.subscriptions = {"on_reply": sub}

    async def get_middleware_key(self) -> str:
        return "tts"

    async def on_reply(self, agent: Any, input_kwargs: ReplyKwargs, next_handler: Any) -> AsyncIterator[Any]:
        blocks: dict[str, _Block] = {}
        spoken = [0]  # raw audio bytes of this reply, against max_reply_audio
        live: _Block | None = None  # the block whose realtime audio may arrive between items
        inner = aiter(next_handler())  # eager_next: called first thing, unchanged
        item_task: asyncio.Future[Any] | None = None
        try:
            while True:
                if item_task is None:
                    item_task = asyncio.ensure_future(anext(inner, _END))
                if live is not None and live.utterance is not None and not live.failed:
                    chunk_task = asyncio.ensure_future(live.utterance.next_chunk())
                    await asyncio.wait((item_task, chunk_task), return_when=asyncio.FIRST_COMPLETED)
                    if chunk_task.done() and not agent.interrupted:  # audio first: made before the item came
                        async for out in self._chunk_result(live, chunk_task):
                            yield out
                        continue
                    chunk_task.cancel()
                item, item_task = await item_task, None
                if item is _END:
                    return
                yield item
                if agent.interrupted:  # the listener has gone: stop speaking, end what is open
                    for block in blocks.values():
                        async for out in self._silence(block):
                            yield out
                    blocks.clear()
                    live = None
                    continue
                if isinstance(item, TextBlockDeltaEvent) and item.delta:
                    if item.block_id not in blocks:  # made once per block; none spoken past the bound
                        failed = spoken[0] >= self.max_reply_audio
                        blocks[item.block_id] = _Block(item.reply_id, failed=failed, spoken=spoken)
                    block = blocks[item.block_id]
                    block.text.append(item.delta)
                    if self.realtime and not block.failed:
                        if block.utterance is None:
                            block.utterance = self.engine.utterance()
                        block.utterance.push(item.delta)
                        live = block
                elif isinstance(item, TextBlockEndEvent) and item.block_id in blocks:
                    block = blocks.pop(item.block_id)
                    live = None if live is block else live
                    async for out in self._finish(block, agent):
                        yield out
        finally:
            if item_task is not None:
                item_task.cancel()
                with contextlib.suppress(BaseException):
                    await item_task
            for block in blocks.values():
                if block.utterance is not None:
                    await block.utterance.aclose()

    async def _finish(self, block: _Block, agent: Any) -> AsyncIterator[Any]:
        """The rest of a block's speech, after its end: the whole text (standard) or a flush;
        it stops at the first piece after an interrupt."""
        try:
            if block.utterance is not None:
                if not block.failed:
                    block.utterance.flush()
                    utterance = block.utterance
                    while (chunk := await self._piece(utterance.next_chunk())) is not None and not agent.interrupted:
                        for out in self._audio(block, chunk):
                            yield out
            elif "".join(block.text).strip() and not block.failed:
                async with contextlib.aclosing(self._speech("".join(block.text))) as speech:
                    async for chunk in speech:
                        if agent.interrupted:  # closing the stream cancels the engine's synthesis
                            break
                        for out in self._audio(block, chunk):
                            yield out
        except Exception as exc:
            if not block.failed:
                yield self._error(block, exc)
        finally:
            if block.utterance is not None:
                await block.utterance.aclose()
        if block.audio_id:
            yield DataBlockEndEvent(reply_id=block.reply_id, block_id=block.audio_id)

    async def _silence(self, block: _Block) -> AsyncIterator[Any]:
        """A block that will not be spoken (the reply was interrupted): its engine let go, its audio
        block, if one was open, ended."""
        if block.utterance is not None:
            await block.utterance.aclose()
        if block.audio_id:
            yield DataBlockEndEvent(reply_id=block.reply_id, block_id=block.audio_id)

    async def _speech(self, text: str) -> AsyncGenerator[bytes, None]:
        """The engine's audio of ``text``, each piece within the engine's timeout (the SDKs' own
        timeouts are per read and retried: a stalled service held a block past the host's timeout,
        which then failed the whole reply)."""
        engine = self.engine
        stream = aiter(engine.synthesize(text))
        try:
            while True:
                chunk = await self._piece(anext(stream, None))
                if chunk is None:
                    return
                yield chunk
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _piece(self, next_piece: Awaitable[bytes | None]) -> bytes | None:
        """The engine's next piece of audio (None: no more), within its timeout: the reply waits for
        it (a whole text's speech, or a realtime block's rest after its end), and a stalled service
        would otherwise hold the reply past the host's timeout, which fails it."""
        try:
            async with asyncio.timeout(self.engine.timeout):
                return await next_piece
        except TimeoutError:
            raise EngineError(f"{self.engine.where()}: no audio within {self.engine.timeout:g}s") from None

    async def _chunk_result(self, block: _Block, task: asyncio.Future[bytes | None]) -> AsyncIterator[Any]:
        try:
            chunk = task.result()
            events = [] if chunk is None else self._audio(block, chunk)
        except Exception as exc:
            block.failed = True
            yield self._error(block, exc)
            return
        for out in events:
            yield out

    def _audio(self, block: _Block, chunk: bytes) -> list[Any]:
        """A chunk as a delta of the block's audio; the first one opens it (its own id). EngineError
        past the reply's MAX_REPLY_AUDIO."""
        block.spoken[0] += len(chunk)
        if block.spoken[0] > self.max_reply_audio:
            raise EngineError(f"the reply's speech stops: more than {self.max_reply_audio} bytes of audio in one reply")
        media_type = self.engine.media_type
        events: list[Any] = []
        if not block.audio_id:
            block.audio_id = new_id()
            events.append(
                DataBlockStartEvent(reply_id=block.reply_id, block_id=block.audio_id, media_type=media_type, name="tts")
            )
        data = base64.b64encode(chunk).decode()
        events.append(
            DataBlockDeltaEvent(reply_id=block.reply_id, block_id=block.audio_id, media_type=media_type, data=data)
        )
        return events

    def _error(self, block: _Block, exc: Exception) -> CustomEvent:
        message = str(exc) or type(exc).__name__
        if not isinstance(exc, EngineError):  # a library's own error: say which engine, and where
            message = f"{self.engine.where()}: {message}"
        return CustomEvent(
            name=ERROR_EVENT,
            value={
                "engine": self.engine.name,
                "reply_id": block.reply_id,
                "error": type(exc).__name__,
                "message": message,
            },
        )


__all__ = [
    "ENGINES",
    "ERROR_EVENT",
    "DashScopeEngine",
    "DashScopeRealtimeEngine",
    "Engine",
    "EngineError",
    "EspeakEngine",
    "PiperEngine",
    "TTSMiddleware",
    "make_engine",
]
