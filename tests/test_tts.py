"""The TTS server (mw_servers/tts) as users run it: ``python -m mw_servers.tts`` in its own process,
attached to an Agent in this process through RemoteMiddleware (or to a host process, for
agent-chat). The speech is real: espeak-ng from its wheel; DashScope is unreachable from here, so
its engines (the real ``dashscope`` SDK clients) talk to tests/dashscope_tts_server.py on 127.0.0.1.
"""

from __future__ import annotations

import array
import asyncio
import base64
import math
import os
import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_host.agent import Agent
from agent_host.models.offline import OfflineRuleModel
from agent_host.remote import Policy, RemoteMiddleware
from agentmw.data import (
    CustomEvent,
    DataBlockDeltaEvent,
    DataBlockEndEvent,
    DataBlockStartEvent,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    TextBlockDeltaEvent,
    TextBlockEndEvent,
    UserMsg,
)
from agentmw.tools import Toolkit, tool
from clients.launch import ROOT, ServerProcess
from mw_servers.tts import EspeakEngine, TTSMiddleware

from .dashscope_tts_server import RATE as DS_RATE
from .dashscope_tts_server import DashScopeTTSServer, speech
from .host_util import Procs, chat

pytestmark = pytest.mark.timeout(60)

SHORT = "Hello there, this is speech."
LONG = (
    "This second answer is a good deal longer than the first one, so its audio must last longer too. "
    "It goes on for a while, with several clauses, and then it stops."
)
SILENCE_RMS = 300  # 16-bit PCM: espeak's speech is in the thousands, silence near zero


@tool(description="Looks something up.")
def lookup(topic: str = "") -> str:
    return f"{topic}: found"


NO_PIPER = "the piper extra is not installed (make test installs it; or pip install '.[piper]')"


# -- helpers ----------------------------------------------------------------------------------------


def tts_server(procs: Procs, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    argv = ["-m", "mw_servers.tts", "--address", "127.0.0.1:0", *args]
    proc = ServerProcess(argv, name="tts", log_dir=procs.log_dir, env=env, startup=20, new_session=True)
    procs.procs.append(proc)
    return proc.start()


async def reply(address: str, script: list[dict[str, Any]], delay: float = 0.0, timeout: float = 10.0) -> list[Any]:
    """Every item of one reply of an Agent (offline model playing ``script``) with the server
    attached (``timeout``: the host's per-message timeout for it)."""
    rm = await RemoteMiddleware(address, policy=Policy(timeout=timeout)).connect()
    try:
        agent = Agent(model=OfflineRuleModel(script=script, delay=delay), toolkit=Toolkit([lookup]), middlewares=[rm])
        return [item async for item in agent.reply_stream(UserMsg("hi"))]
    finally:
        await rm.close()


def text_blocks(items: list[Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        if isinstance(item, TextBlockDeltaEvent):
            out[item.block_id] = out.get(item.block_id, "") + item.delta
    return out


def audio_blocks(items: list[Any]) -> dict[str, tuple[str, bytes]]:
    """block id -> (media type, the decoded deltas concatenated)."""
    media: dict[str, str] = {}
    data: dict[str, bytes] = {}
    for item in items:
        if isinstance(item, DataBlockStartEvent):
            assert item.block_id not in media, "an audio block started twice"
            media[item.block_id], data[item.block_id] = item.media_type, b""
        elif isinstance(item, DataBlockDeltaEvent):
            assert item.media_type == media[item.block_id]
            data[item.block_id] += base64.b64decode(item.data)
    return {block_id: (media[block_id], data[block_id]) for block_id in media}


def rms(pcm: bytes) -> float:
    samples = array.array("h", pcm)
    return math.sqrt(sum(s * s for s in samples) / max(len(samples), 1))


def seconds(media_type: str, pcm: bytes) -> float:
    rate = int(media_type.split("rate=")[1])
    return len(pcm) / 2 / rate


def assert_speech(media_type: str, pcm: bytes) -> None:
    assert media_type == "audio/pcm;rate=22050"
    assert len(pcm) % 2 == 0 and seconds(media_type, pcm) > 0.5
    assert rms(pcm) > SILENCE_RMS, "the audio is silent"


def assert_proportional(short: tuple[str, bytes], long: tuple[str, bytes], short_text: str, long_text: str) -> None:
    """A longer text gives proportionally longer audio: the duration ratio is near the length ratio."""
    text_ratio = len(long_text) / len(short_text)
    audio_ratio = seconds(*long) / seconds(*short)
    assert 0.6 * text_ratio < audio_ratio < 1.6 * text_ratio, (audio_ratio, text_ratio)


def kinds(items: list[Any]) -> list[str]:
    return [type(i).__name__ for i in items]


# -- espeak-ng: standard and realtime modes (the standard one runs piper too) -------------------------


@pytest.mark.parametrize("engine", ["espeak", "piper"])
async def test_standard_mode_speaks_each_text_block_after_it_ends(procs: Procs, engine: str) -> None:
    if engine == "piper":  # the optional extra: the neural voice, run as a user runs it
        pytest.importorskip("piper", reason=NO_PIPER)
    server = tts_server(procs, "--engine", engine)
    script = [
        {
            "thinking": "The user greets; look something up first.",
            "text": SHORT,
            "tool_calls": [{"name": "lookup", "input": {"topic": "x"}}],
        },
        {"text": LONG},
    ]
    items = await reply(server.address, script)

    texts, audio = text_blocks(items), audio_blocks(items)
    assert list(texts.values()) == [SHORT, LONG]
    assert len(audio) == 2, "one audio block per text block; thinking and tool results are not spoken"
    names = kinds(items)
    for text_id, (audio_id, (media_type, pcm)) in zip(texts, audio.items(), strict=True):
        end = next(i for i, x in enumerate(items) if isinstance(x, TextBlockEndEvent) and x.block_id == text_id)
        start = next(i for i, x in enumerate(items) if isinstance(x, DataBlockStartEvent) and x.block_id == audio_id)
        stop = next(i for i, x in enumerate(items) if isinstance(x, DataBlockEndEvent) and x.block_id == audio_id)
        # The audio comes right after the text block's end, whole: start, deltas, end.
        assert start == end + 1 and names[start + 1 : stop] == ["DataBlockDeltaEvent"] * (stop - start - 1)
        # Streamed in pieces: espeak-ng's of 50 ms; piper's one per sentence (docs/tts.md).
        assert stop - start - 1 >= (5 if engine == "espeak" else 1), "the audio is streamed in pieces"
        assert {x.reply_id for x in items[start : stop + 1]} == {items[end].reply_id}
        assert_speech(media_type, pcm)
    assert_proportional(*audio.values(), SHORT, LONG)
    assert isinstance(items[-1], Msg) and items[-1].text == LONG
    assert not any(isinstance(x, CustomEvent) for x in items)


async def test_realtime_mode_audio_interleaves_with_the_text(procs: Procs) -> None:
    server = tts_server(procs, "--realtime")
    items = await reply(server.address, [{"text": LONG}], delay=0.01)

    names = kinds(items)
    text_end = names.index("TextBlockEndEvent")
    first_audio = names.index("DataBlockDeltaEvent")
    assert names.index("DataBlockStartEvent") < first_audio < text_end, "the first audio comes before the text ends"
    assert "TextBlockDeltaEvent" in names[first_audio:text_end], "audio and text interleave"
    assert names.index("DataBlockEndEvent") > text_end, "the rest is flushed after the block's end"
    assert names[names.index("DataBlockEndEvent") + 1 :] == ["ModelCallEndEvent", "ReplyEndEvent", "Msg"]
    (audio,) = audio_blocks(items).values()
    assert_speech(*audio)
    assert text_blocks(items) == {items[text_end].block_id: LONG}

    short = audio_blocks(await reply(server.address, [{"text": SHORT}], delay=0.01))
    assert_proportional(*short.values(), audio, SHORT, LONG)


async def test_concurrent_replies_keep_their_audio_apart(procs: Procs) -> None:
    server = tts_server(procs)
    texts = [SHORT, LONG]
    replies = await asyncio.gather(*(reply(server.address, [{"text": t}], delay=0.002) for t in texts))

    alone = EspeakEngine()  # the same library in this process: the duration each text has on its own
    block_ids = set()
    for text, items in zip(texts, replies, strict=True):
        reply_id = items[-1].id
        data_events = [x for x in items if isinstance(x, DataBlockStartEvent | DataBlockDeltaEvent | DataBlockEndEvent)]
        assert {x.reply_id for x in data_events} == {reply_id}
        ((block_id, audio),) = audio_blocks(items).items()
        block_ids.add(block_id)
        assert_speech(*audio)
        expected = b"".join([chunk async for chunk in alone.synthesize(text)])
        assert abs(len(audio[1]) - len(expected)) < 0.05 * len(expected), "the audio is this reply's text only"
    assert len(block_ids) == 2


# -- DashScope against a local server ----------------------------------------------------------------


@pytest.fixture
def dashscope() -> Iterator[DashScopeTTSServer]:
    with DashScopeTTSServer() as server:
        yield server


def dashscope_env() -> dict[str, str]:
    return {"DASHSCOPE_API_KEY": "sk-tts-test"}


async def test_dashscope_standard_streams_qwen_tts_over_http(procs: Procs, dashscope: DashScopeTTSServer) -> None:
    args = ["--engine", "dashscope", "--url", dashscope.http_url, "--voice", "Ethan", "--language", "English"]
    server = tts_server(procs, *args, env=dashscope_env())
    items = await reply(server.address, [{"text": SHORT}])

    ((media_type, pcm),) = audio_blocks(items).values()
    assert media_type == f"audio/pcm;rate={DS_RATE}"
    assert pcm == speech(SHORT), "every streamed piece arrives, in order"
    names = kinds(items)
    assert names.index("DataBlockStartEvent") == names.index("TextBlockEndEvent") + 1
    (request,) = dashscope.requests
    assert request["body"]["model"] == "qwen3-tts-flash"
    assert request["body"]["input"] == {"text": SHORT, "voice": "Ethan", "language_type": "English"}
    assert request["headers"]["Authorization"] == "Bearer sk-tts-test"
    assert request["headers"]["X-DashScope-SSE"] == "enable"


async def test_dashscope_realtime_pushes_deltas_over_websocket(procs: Procs, dashscope: DashScopeTTSServer) -> None:
    args = ["--engine", "dashscope-realtime", "--url", dashscope.ws_url, "--voice", "Chelsie", "--language", "English"]
    server = tts_server(procs, *args, env=dashscope_env())
    items = await reply(server.address, [{"text": LONG}], delay=0.01)

    names = kinds(items)
    assert names.index("DataBlockDeltaEvent") < names.index("TextBlockEndEvent"), "audio before the text ends"
    ((media_type, pcm),) = audio_blocks(items).values()
    appended = [e["text"] for e in dashscope.events if e["type"] == "input_text_buffer.append"]
    assert "".join(appended) == LONG and len(appended) > 5, "each delta went out as it came"
    assert media_type == f"audio/pcm;rate={DS_RATE}"
    assert pcm == b"".join(speech(t) for t in appended)
    (update,) = [e for e in dashscope.events if e["type"] == "session.update"]
    assert update["session"]["voice"] == "Chelsie" and update["session"]["mode"] == "server_commit"
    assert update["session"]["language_type"] == "English"
    assert dashscope.events[-1]["type"] == "session.finish"
    assert dashscope.headers[0]["Authorization"] == "Bearer sk-tts-test"
    assert dashscope.headers[0]["query"] == "model=qwen3-tts-flash-realtime"


# -- engine errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["dashscope", "dashscope-realtime"])
async def test_engine_error_is_an_event_and_the_text_arrives_whole(
    procs: Procs, dashscope: DashScopeTTSServer, engine: str
) -> None:
    url = dashscope.ws_url if engine == "dashscope-realtime" else dashscope.http_url
    server = tts_server(procs, "--engine", engine, "--url", url, env=dashscope_env())
    dashscope.fail = "the synthesizer is on fire"
    items = await reply(server.address, [{"text": LONG}], delay=0.002)

    assert list(text_blocks(items).values()) == [LONG]
    assert isinstance(items[-1], Msg) and items[-1].text == LONG
    end = next(x for x in items if isinstance(x, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.COMPLETED
    (error,) = [x for x in items if isinstance(x, CustomEvent)]
    assert error.name == "tts_error" and "the synthesizer is on fire" in error.value["message"]
    assert error.value["engine"] == engine and error.value["reply_id"] == end.reply_id


@pytest.mark.parametrize("mode", ["standard", "realtime"])
async def test_a_stalled_service_costs_the_speech_not_the_reply(
    procs: Procs, dashscope: DashScopeTTSServer, mode: str
) -> None:
    """The DashScope endpoint takes the request and then sends nothing: the block's speech is given
    up after --timeout (a tts_error naming the endpoint) and the text arrives whole, within the
    host's timeout for the server. Before, only the SDK's per-read timeout bounded it: retried, it
    held a block ~16 s with the default 8, past the host's default 10 s, which failed the whole
    reply; and its error (SocketTimeoutError) did not say where. In realtime mode the wait for the
    rest of the speech at the block's end had no bound at all: the reply failed at the host's."""
    dashscope.stall = 30.0
    args = ["--engine", "dashscope", "--url", dashscope.http_url, "--timeout", "2"]
    args += ["--realtime"] if mode == "realtime" else []
    server = tts_server(procs, *args, env=dashscope_env())
    items = await reply(server.address, [{"text": SHORT}], timeout=3.5)  # the SDK alone: 2 x 2 s and more

    end = next(x for x in items if isinstance(x, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
    assert isinstance(items[-1], Msg) and items[-1].text == SHORT
    (error,) = [x for x in items if isinstance(x, CustomEvent)]
    assert error.name == "tts_error" and error.value["error"] == "EngineError"
    assert error.value["message"] == f"dashscope qwen3-tts-flash at {dashscope.http_url}: no audio within 2s"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--engine", "espeak", "--voice", "klingon-xx"], "espeak-ng has no voice 'klingon-xx'"),
        (["--engine", "dashscope"], "DashScope TTS: no API key (set DASHSCOPE_API_KEY)"),
        (["--address", "127.0.0.1:99999"], "--address '127.0.0.1:99999' is not HOST:PORT"),
    ],
)
def test_a_server_that_could_not_speak_refuses_to_start(flags: list[str], says: str) -> None:
    """An unknown voice or no DashScope key failed every reply later (a tts_error event each), and
    the server looked healthy; now it does not start, with one line (exit 2)."""
    env = {k: v for k, v in os.environ.items() if k != "DASHSCOPE_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "mw_servers.tts", "--address", "127.0.0.1:0", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"python -m mw_servers.tts: error: {says}"), done.stderr


# -- piper (the optional extra; make test installs it) -----------------------------------------------


async def test_piper_engine_speaks() -> None:
    pytest.importorskip("piper", reason=NO_PIPER)
    from mw_servers.tts import PiperEngine

    engine = PiperEngine()
    pcm = b"".join([chunk async for chunk in engine.synthesize(SHORT)])
    assert_speech(engine.media_type, pcm)


def test_a_piper_voice_that_cannot_load_refuses_the_start(tmp_path: Path) -> None:
    """A missing model, or one that does not load, is one line at start (exit 2). Before: a
    traceback, or a server that started and then failed every reply with a tts_error."""
    pytest.importorskip("piper", reason=NO_PIPER)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    (tmp_path / "broken.onnx.json").write_text('{"audio": {"sample_rate": 22050}}')
    for voice, says in ((tmp_path / "missing.onnx", "cannot read its config"), (broken, "does not load")):
        argv = [sys.executable, "-m", "mw_servers.tts", "--address", "127.0.0.1:0", "--engine", "piper"]
        done = subprocess.run([*argv, "--voice", str(voice)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and says in done.stderr.strip().splitlines()[-1], done.stderr


# -- agent-chat: saved as WAV, played -----------------------------------------------------------------


async def test_agent_chat_saves_the_speech_as_wav_and_plays_it(
    procs: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = tts_server(procs)
    host = procs.host(tmp_path / "sessions.db", "--middleware", f"tts={server.address}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    played = tmp_path / "played.txt"
    player = bin_dir / "aplay"  # a stand-in player on PATH: records what it was asked to play
    player.write_text(f'#!/bin/sh\nfor a in "$@"; do echo "$a" >> {played}; done\n')
    player.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    done = chat(host.address, "--message", "hello there", "--audio-dir", str(tmp_path / "audio"), "--play")
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = (tmp_path / "audio").glob("*.wav")
    assert f"[audio saved to {path}]" in done.stdout
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        pcm = w.readframes(w.getnframes())
    assert_speech("audio/pcm;rate=22050", pcm)
    assert str(path) in played.read_text().split("\n")


# -- interruption -----------------------------------------------------------------------------------

SPEECH = " ".join([LONG] * 24)  # ~660 words: thousands of audio pieces, so speech that goes on is plain


def _audio_after(items: list[Any], index: int) -> int:
    return sum(isinstance(x, DataBlockDeltaEvent) for x in items[index + 1 :])


@pytest.mark.parametrize("realtime", [False, True], ids=["standard", "realtime"])
async def test_speech_past_the_replys_audio_bound_stops_and_the_text_goes_on(realtime: bool) -> None:
    """A reply whose speech would pass max_reply_audio (by default 32 MiB, under the 64 MiB the
    host takes from one hook call once base64-encoded): one tts_error, its audio block ended, the
    text whole; the next reply speaks afresh. Before, a ~23,000-character reply failed with
    OutputLimitExceeded from the host: ERROR, where only its speech should have been lost."""
    bound = 200_000
    layers = [TTSMiddleware(EspeakEngine(), realtime=realtime, max_reply_audio=bound)]
    agent = Agent(model=OfflineRuleModel(script=[{"text": SPEECH}, {"text": SPEECH}]), middlewares=layers)
    async with asyncio.timeout(60):
        first = [item async for item in agent.reply_stream(UserMsg("hi"))]
        second = [item async for item in agent.reply_stream(UserMsg("again"))]
    for items in (first, second):  # the bound is per reply: the next one speaks afresh
        end = next(x for x in items if isinstance(x, ReplyEndEvent))
        assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
        assert isinstance(items[-1], Msg) and items[-1].text == SPEECH
        (error,) = [x for x in items if isinstance(x, CustomEvent)]
        assert "the reply's speech stops: more than 200000 bytes of audio" in error.value["message"], error
        names = kinds(items)
        assert names.count("DataBlockStartEvent") == names.count("DataBlockEndEvent") == 1, names
        spoken = sum(len(base64.b64decode(x.data)) for x in items if isinstance(x, DataBlockDeltaEvent))
        assert 0 < spoken <= bound, spoken


@pytest.mark.parametrize("realtime", [False, True], ids=["standard", "realtime"])
@pytest.mark.parametrize("placement", ["remote", "in-process"])
async def test_an_interrupt_stops_the_speech_at_its_next_piece(procs: Procs, placement: str, realtime: bool) -> None:
    """The user interrupts while the reply is being spoken (barge-in), once nearly all of its text
    has streamed: the speech stops within the pieces already under way, its audio block is ended,
    and the reply ends well formed, with no failure of the TTS middleware. Remotely the host's
    Interrupted notice reaches the server while it emits audio without reading (run_ahead);
    in-process the same class reads agent.interrupted. Before, all of the text was spoken after
    the interrupt (remotely, a speech past 2 s was left behind as a failure)."""
    flags = ["--realtime"] if realtime else []
    script = [{"text": SPEECH}]
    if placement == "remote":
        rm = await RemoteMiddleware(tts_server(procs, *flags).address, policy=Policy(timeout=10)).connect()
        layers: list[Any] = [rm]
    else:
        layers = [TTSMiddleware(EspeakEngine(), realtime=realtime)]
    texts = SPEECH.count(" ") + 1  # the offline model streams a word per delta

    async def run(interrupt: bool) -> tuple[list[Any], int]:
        """The reply's items, and the index of the audio delta it was interrupted at (the first one
        after nine tenths of the text deltas)."""
        agent = Agent(model=OfflineRuleModel(script=script), middlewares=layers)
        items: list[Any] = []
        seen, at = 0, -1
        async for item in agent.reply_stream(UserMsg("hi")):
            items.append(item)
            seen += isinstance(item, TextBlockDeltaEvent)
            if at < 0 and isinstance(item, DataBlockDeltaEvent) and seen >= 0.9 * texts:
                at = len(items) - 1
                if interrupt:
                    agent.interrupt()
        return items, at

    try:
        whole, at_whole = await run(interrupt=False)
        items, at = await run(interrupt=True)
    finally:
        if placement == "remote":
            await rm.close()
    left, after = _audio_after(whole, at_whole), _audio_after(items, at)
    assert left > 100, f"without the interrupt, {left} audio pieces follow that point"
    # Those under way may be many on a loaded machine (espeak-ng makes them faster than the host
    # reads them: over 40 % once, under three test workers); without the stop it is all of them.
    assert after < 0.8 * left, f"{after} audio pieces went out after the interrupt ({left} without it)"
    names = kinds(items)
    assert names.count("DataBlockStartEvent") == names.count("DataBlockEndEvent") == 1, names
    end = next(x for x in items if isinstance(x, ReplyEndEvent))
    # INTERRUPTED when the interrupt cut the model's stream (realtime speech starts while it
    # streams); COMPLETED when the model's part was done (standard speech starts after the text).
    assert end.finished_reason in (ReplyFinishedReason.INTERRUPTED, ReplyFinishedReason.COMPLETED), end
    assert not any(isinstance(x, CustomEvent) for x in items), "no failure, no bypass"
