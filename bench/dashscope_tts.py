"""A local stand-in for DashScope's standard TTS endpoint (qwen3-tts-flash over HTTP/SSE), as a
process of its own, for the four-servers bench: our TTS server and AgentScope's DashScopeTTSModel
both speak to it, so neither side synthesizes audio on the host and both get the same audio.

``python -m bench.dashscope_tts --address 127.0.0.1:{port}``. It answers
``POST /api/v1/services/aigc/multimodal-generation/generation`` with an SSE stream in the wire
format the ``dashscope`` SDK reads (as tests/dashscope_tts_server.py does), silence PCM at 24 kHz,
``MS_PER_CHAR`` of audio per character of text in 0.1 s pieces: cheap to make, sized like speech.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json

from aiohttp import web

PATH = "/api/v1/services/aigc/multimodal-generation/generation"
PIECE = base64.b64encode(bytes(4800)).decode()  # 0.1 s of 16-bit mono PCM at 24 kHz
MS_PER_CHAR = 2.0  # ~1/30 of real speech: a 5,000-character reply makes 10 s of audio, 100 pieces


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    text = body["input"]["text"]
    count = max(1, round(len(text) * MS_PER_CHAR / 100))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream;charset=UTF-8"})
    await response.prepare(request)
    for i in range(1, count + 1):
        output = {
            "finish_reason": "stop" if i == count else "null",
            "audio": {"data": PIECE, "id": "audio-1", "expires_at": 0, "url": ""},
        }
        event = {"output": output, "usage": {"characters": len(text)}, "request_id": "bench-tts"}
        await response.write(f"id:{i}\nevent:result\n:HTTP_STATUS/200\ndata:{json.dumps(event)}\n\n".encode())
    await response.write_eof()
    return response


async def serve(host: str, port: int) -> None:
    app = web.Application()
    app.router.add_post(PATH, generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"listening on {host}:{bound}", flush=True)  # what clients.launch.ServerProcess waits for
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dashscope_tts", description=__doc__)
    parser.add_argument("--address", default="127.0.0.1:0")
    host, port = parser.parse_args().address.rsplit(":", 1)
    asyncio.run(serve(host, int(port)))


if __name__ == "__main__":
    main()
