"""Local model servers for the model tests: real HTTP on 127.0.0.1, speaking each provider's wire.

DashScope and OpenAI are unreachable from here, so the real clients (the ``dashscope`` SDK,
``httpx``) are tested against a scripted ``http.server`` in a thread. Each POST takes the next
scripted reply: an SSE stream (written with chunked transfer encoding, one chunk per event and a
flush between, so the client really receives it piecewise) or a JSON error with a status.
Every request is recorded (path, headers, JSON body) for assertions.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Reply:
    """One scripted answer. Fault modes: ``headers`` (e.g. Retry-After, x-request-id), ``raw``
    (any body with any ``content_type``: an HTML page with status 200 or 502, an empty body),
    ``stall`` (seconds before the status line: a late answer), frames without a finish reason
    or ``[DONE]`` (a truncated stream), DashScope error frames inside a 200 stream, ``reset``
    (the connection reset after the frames, or right after the request without frames)."""

    status: int = 200
    body: Any = None  # a JSON error body (status != 200) or a complete JSON answer
    frames: list[str] = field(default_factory=list)  # SSE frames, written one by one
    delay: float = 0.0  # seconds between frames
    headers: dict[str, str] = field(default_factory=dict)
    raw: str | None = None  # sent as is instead of ``body`` / ``frames``
    content_type: str = "application/json"
    stall: float = 0.0
    reset: bool = False


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float = field(default_factory=time.monotonic)  # when it arrived (for gaps between retries)


class _Server(ThreadingHTTPServer):
    block_on_close = False  # keep-alive handler threads must not delay stop()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client hanging up is normal
            super().handle_error(request, client_address)


class ScriptedServer:
    """``with ScriptedServer() as server: server.replies.append(...); ... server.url``"""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="model-server", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def _next(self, request: Request) -> Reply:
        with self._lock:
            self.requests.append(request)
            if self.replies:
                return self.replies.pop(0)
        return Reply(status=500, body={"code": "ScriptExhausted", "message": "no scripted reply left"})

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive and chunked streams, as the real services
            timeout = 10  # an idle keep-alive connection's thread ends after this

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = Request(self.path, {k.lower(): v for k, v in self.headers.items()}, json.loads(raw or b"{}"))
                reply = server._next(request)
                if reply.stall:
                    time.sleep(reply.stall)
                if reply.reset:
                    self._reset(reply)
                elif reply.frames:
                    self._stream(reply)
                else:
                    self._json(reply)

            def _headers(self, reply: Reply) -> None:
                for name, value in reply.headers.items():
                    self.send_header(name, value)

            def _json(self, reply: Reply) -> None:
                data = (reply.raw if reply.raw is not None else json.dumps(reply.body)).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                self.send_header("Content-Length", str(len(data)))
                self._headers(reply)
                self.end_headers()
                self.wfile.write(data)

            def _reset(self, reply: Reply) -> None:
                """The frames (no terminating chunk), then an RST: a connection dropped mid-answer."""
                if reply.frames:
                    self._stream(reply, end=False)
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True

            def _stream(self, reply: Reply, end: bool = True) -> None:
                self.send_response(reply.status)
                self.send_header("Content-Type", "text/event-stream;charset=UTF-8")
                self._headers(reply)
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                for frame in reply.frames:
                    data = frame.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    if reply.delay:
                        time.sleep(reply.delay)
                if end:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        return Handler


# -- DashScope: text-generation SSE (result_format="message", incremental_output=True) ---------

DASHSCOPE_PATH = "/api/v1/services/aigc/text-generation/generation"


def dashscope_chunk(
    content: str = "",
    *,
    reasoning: str = "",
    tool_calls: list[dict[str, Any]] | None = None,
    finish: str = "null",
    usage: tuple[int, int] = (0, 0),
    request_id: str = "req-ds-1",
) -> dict[str, Any]:
    """One event's JSON: ``output.choices[0].message`` with only the new fragments, and the usage
    so far (DashScope sends cumulative usage in every event; ``finish_reason`` is "null" until the end)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    input_tokens, output_tokens = usage
    return {
        "output": {"choices": [{"message": message, "finish_reason": finish}]},
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
        },
        "request_id": request_id,
    }


def dashscope_tool_fragment(index: int, arguments: str, *, id: str = "", name: str = "") -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": arguments}
    if name:
        function["name"] = name
    return {"index": index, "id": id, "type": "function", "function": function}


def dashscope_stream(chunks: list[dict[str, Any]], delay: float = 0.0, *, complete: bool = True) -> Reply:
    """A complete stream: when no chunk has a finish reason, the last one says "stop" (as the real
    service's last event does). ``complete=False``: as given (a truncated stream)."""
    if (
        complete
        and chunks
        and all(c["output"]["choices"][0]["finish_reason"] == "null" for c in chunks if "output" in c)
    ):
        chunks = [*chunks[:-1], json.loads(json.dumps(chunks[-1]))]
        if "output" in chunks[-1]:
            chunks[-1]["output"]["choices"][0]["finish_reason"] = "stop"
    frames = [
        f"id:{i}\nevent:result\n:HTTP_STATUS/200\ndata:{json.dumps(chunk, ensure_ascii=False)}\n\n"
        for i, chunk in enumerate(chunks, 1)
    ]
    return Reply(frames=frames, delay=delay)


def dashscope_error_frame(code: str, message: str, status: int = 500, request_id: str = "req-ds-1") -> str:
    """An error event inside a 200 stream, as the service sends one after it has started."""
    body = json.dumps({"code": code, "message": message, "request_id": request_id})
    return f"id:99\nevent:error\n:HTTP_STATUS/{status}\ndata:{body}\n\n"


def dashscope_error(status: int, code: str, message: str) -> Reply:
    return Reply(status=status, body={"code": code, "message": message, "request_id": "req-ds-err"})


# -- OpenAI chat completions SSE ----------------------------------------------------------------

OPENAI_PATH = "/v1/chat/completions"


def openai_chunk(
    content: str | None = None,
    *,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    finish: str | None = None,
    id: str = "chatcmpl-1",
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def openai_usage_chunk(
    prompt_tokens: int, completion_tokens: int, id: str = "chatcmpl-1", *, cached: int = 0, reasoning: int = 0
) -> dict[str, Any]:
    """The extra last chunk that ``stream_options.include_usage`` asks for: no choices, only usage
    (with ``cached`` / ``reasoning``: its prompt and completion token details, as OpenAI sends them)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    chunk = {"id": id, "object": "chat.completion.chunk", "created": 1700000000, "model": "m", "choices": []}
    return {**chunk, "usage": usage}


def openai_tool_fragment(index: int, arguments: str, *, id: str | None = None, name: str | None = None) -> dict:
    function: dict[str, Any] = {"arguments": arguments}
    fragment: dict[str, Any] = {"index": index, "function": function}
    if id is not None:  # only the first fragment of a call carries id, type and name
        fragment.update(id=id, type="function")
        function["name"] = name
    return fragment


def openai_stream(chunks: list[dict[str, Any]], delay: float = 0.0, *, done: bool = True) -> Reply:
    """A complete stream: when no chunk has a finish reason, one with "stop" is added before the
    usage-only chunk (real servers always send one), and ``data: [DONE]`` ends it.
    ``done=False``: as given, without ``[DONE]`` (a truncated stream)."""
    finished = any(c.get("finish_reason") for chunk in chunks for c in chunk.get("choices") or [])
    if done and not finished and not any("error" in chunk for chunk in chunks):
        at = next((i for i, c in enumerate(chunks) if not c.get("choices")), len(chunks))
        chunks = [
            *chunks[:at],
            openai_chunk(finish="stop", id=chunks[0].get("id", "chatcmpl-1") if chunks else "chatcmpl-1"),
            *chunks[at:],
        ]
    frames = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return Reply(frames=[*frames, "data: [DONE]\n\n"] if done else frames, delay=delay)


def openai_error(status: int, message: str, type: str, code: str | None = None) -> Reply:
    return Reply(status=status, body={"error": {"message": message, "type": type, "param": None, "code": code}})


# -- running the agent -------------------------------------------------------------------------


async def run_reply(agent: Any, text: str) -> tuple[list[Any], Any]:
    """Every event of one reply to ``text``, and the final Msg."""
    from agentmw.data import UserMsg

    items = [item async for item in agent.reply_stream(UserMsg(text))]
    return items[:-1], items[-1]


def of_type(events: list[Any], cls: type) -> list[Any]:
    return [e for e in events if isinstance(e, cls)]


# -- model-client tests' shared setup -------------------------------------------------------------

FAST = {"initial_delay": 0.02, "max_delay": 2.0, "deadline": 20.0}  # a model's retry: waits, short


@pytest.fixture(autouse=True)
async def close_sdk_session() -> Any:
    """Autouse in a module that imports it: the dashscope SDK's shared aiohttp session, closed
    after each test (it belongs to that test's event loop)."""
    yield
    import dashscope

    await dashscope.close_shared_aio_session()


def spec(server: ScriptedServer, provider: str = "openai", **extra: Any) -> dict[str, Any]:
    """A host.yaml model entry for ``server``, as ``provider`` speaks to it."""
    base = f"{server.url}/v1" if provider == "openai" else f"{server.url}/api/v1"
    return {"provider": provider, "model_name": "m", "base_url": base, "api_key": "sk-x", "retry": FAST, **extra}


async def reply(reg: Any, text: str = "hi", **agent_kw: Any) -> tuple[list[Any], Any, Any]:
    """One reply of an agent on ``reg``'s default model: (events, final Msg, agent)."""
    from agent_host.agent import Agent

    agent = Agent(models=reg, model=reg.default, **agent_kw)
    try:
        events, final = await run_reply(agent, text)
    finally:
        await reg.aclose()
    return events, final, agent
