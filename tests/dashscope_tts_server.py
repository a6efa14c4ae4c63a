"""A local DashScope TTS server for the tests: real HTTP and WebSocket on 127.0.0.1, speaking the
wire protocols the ``dashscope`` SDK expects (read from the SDK's source).

* Standard, ``qwen3-tts-flash``: ``POST /api/v1/services/aigc/multimodal-generation/generation``
  with ``{"model", "input": {"text", "voice", "language_type"}, "parameters"}`` and the header
  ``X-DashScope-SSE: enable``; the answer is an SSE stream (``id:`` / ``event:result`` /
  ``:HTTP_STATUS/200`` / ``data:``), each event's ``output.audio.data`` a base64 piece of 24 kHz
  16-bit mono PCM, the last with ``finish_reason: "stop"`` and the usage.
* Realtime, ``qwen3-tts-flash-realtime`` (``QwenTtsRealtime``): a WebSocket at
  ``/api-ws/v1/realtime?model=...``. The server opens with ``session.created``; the client sends
  ``session.update`` (answered ``session.updated``), ``input_text_buffer.append`` (in
  server_commit mode the server speaks each appended text at once: ``response.created`` the
  first time, then ``response.audio.delta`` events), and ``session.finish`` (answered
  ``response.audio.done``, ``response.done``, ``session.finished``; then it closes).

The "speech" is a tone, ``speech(text)``: 40 ms per character, so a test can check that the audio
arrives whole and in proportion to the text. ``fail`` makes the next request fail (HTTP 500 with a
DashScope error body, or an ``error`` event on the socket). Requests and socket events are recorded.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import threading
from typing import Any

from aiohttp import WSMsgType, web

RATE = 24000
SECONDS_PER_CHAR = 0.04
PIECE = 4800  # bytes of PCM per streamed piece (0.1 s)
HTTP_PATH = "/api/v1/services/aigc/multimodal-generation/generation"
WS_PATH = "/api-ws/v1/realtime"


def speech(text: str) -> bytes:
    """The "speech" of ``text``: a 300 Hz tone, 40 ms per character, 16-bit mono PCM at 24 kHz."""
    frames = int(len(text) * SECONDS_PER_CHAR * RATE)
    return b"".join(struct.pack("<h", round(8000 * math.sin(2 * math.pi * 300 * i / RATE))) for i in range(frames))


def _pieces(data: bytes) -> list[str]:
    return [base64.b64encode(data[i : i + PIECE]).decode() for i in range(0, len(data), PIECE)]


class DashScopeTTSServer:
    """``with DashScopeTTSServer() as s: s.http_url, s.ws_url``; runs in a thread of its own."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []  # {"path", "headers", "body"} per HTTP request
        self.events: list[dict[str, Any]] = []  # client events on the sockets
        self.headers: list[dict[str, str]] = []  # each socket's handshake headers
        self.fail: str = ""  # the next request fails with this message
        self.stall = 0.0  # seconds each HTTP request waits, its response begun, before any audio
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashscope-tts", daemon=True)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}{WS_PATH}"

    def __enter__(self) -> DashScopeTTSServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the DashScope TTS server did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post(HTTP_PATH, self._http)
        app.router.add_get(WS_PATH, self._ws)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def _take_failure(self) -> str:
        fail, self.fail = self.fail, ""
        return fail

    async def _http(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        if fail := self._take_failure():
            error = {"code": "InternalError", "message": fail, "request_id": "req-tts-err"}
            return web.json_response(error, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream;charset=UTF-8"})
        await response.prepare(request)
        if self.stall:  # a service that took the request and stalled (until the server stops)
            try:
                await asyncio.wait_for(self._stop.wait(), self.stall)
            except TimeoutError:
                pass
            else:  # stopping: end the stalled request now, not when the stall is over
                return response
        text = body["input"]["text"]
        pieces = _pieces(speech(text))
        for i, piece in enumerate(pieces, 1):
            last = i == len(pieces)
            output = {
                "finish_reason": "stop" if last else "null",
                "audio": {"data": piece, "id": "audio-1", "expires_at": 0, "url": ""},
            }
            event = {"output": output, "usage": {"characters": len(text)}, "request_id": "req-tts-1"}
            await response.write(f"id:{i}\nevent:result\n:HTTP_STATUS/200\ndata:{json.dumps(event)}\n\n".encode())
            await asyncio.sleep(0.002)  # streamed, not one write
        await response.write_eof()
        return response

    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        self.headers.append({**dict(request.headers), "query": request.query_string})
        ws = web.WebSocketResponse()
        await ws.prepare(request)

        async def send(kind: str, **fields: Any) -> None:
            await ws.send_str(json.dumps({"event_id": f"event_{len(self.events)}", "type": kind, **fields}))

        await send("session.created", session={"id": "sess-1"})
        responding = False
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                break
            event = json.loads(msg.data)
            self.events.append(event)
            kind = event.get("type")
            if kind == "session.update":
                await send("session.updated", session=event.get("session", {}))
            elif kind == "input_text_buffer.append":
                if fail := self._take_failure():
                    await send("error", error={"type": "server_error", "code": "InternalError", "message": fail})
                    continue
                if not responding:
                    responding = True
                    await send("response.created", response={"id": "resp-1"})
                for piece in _pieces(speech(event["text"])):
                    await send("response.audio.delta", response_id="resp-1", delta=piece)
            elif kind == "session.finish":
                await send("response.audio.done", response_id="resp-1")
                await send("response.done", response={"id": "resp-1"})
                await send("session.finished")
                await ws.close()
        return ws
