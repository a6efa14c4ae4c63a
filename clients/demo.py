"""``make demo`` (``python -m clients.demo``): the whole system, offline, no keys.

It starts every middleware server the repository has, each as its own process on a free
loopback port (built-in servers ``mw_servers/<name>/`` through their ``__main__``, and every
middleware class in ``mw_servers/examples/`` through the SDK launcher), then the agent host with
all of them attached and two offline models ("offline", the default, and "backup"), then runs a
scripted conversation on one session: a tool call, an email that needs confirmation (answered
automatically, with an edited input), a tool the client executes, a model that keeps calling a
tool until the budget server stops it, each middleware-contributed tool, a question the offline
model answers from its (dynamic) system prompt, a simulated outage of the default model that the
fallback middleware answers with "backup", and a follow-up turn.
It prints what happened (with the model that answered each model call) and what each middleware
kept in the session, and stops every process it started, also on an error or Ctrl-C. Exit status
0 means every reply completed. Every process traces to an OTLP receiver in the demo itself
(clients/traces.py; the tracing server ``mw_servers/tracing`` is one of the middleware), and the
span tree of each reply is printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import importlib
import inspect
import json
import pkgutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .launch import ROOT, LaunchError, ServerProcess, start_all
from .traces import Receiver, format_trace

# Constructor arguments some example servers need to be useful in the demo. The rate limit lets
# a burst of 4 calls through, then 20 a second: the demo's later calls wait a little for a token.
SERVER_ARGS: dict[str, dict[str, Any]] = {
    "ModelFallbackMiddleware": {"fallback": "backup"},
    "RateLimitMiddleware": {"rate": 20, "burst": 4},
}

# Flags of the built-in servers (``python -m mw_servers.<name>``); "{tmp}" is the demo's temporary
# directory. The budget counts output tokens only, so the session's growing context does not use it
# up in the other steps: 3 is three single-tool-call model turns, and the fourth step of that reply
# must answer without tools.
PACKAGE_ARGS: dict[str, list[str]] = {
    "budget": ["--token-budget", "3", "--input-token-weight", "0", "--output-token-weight", "1"],
    "mem0": ["--store", "{tmp}/mem0-store"],
}
BUDGET_STEP = "Keep watching the forecast for Paris"

OUTAGE = "the primary model is down (simulated outage)"

# Built-in servers with a venv of their own (the demo builds it: `make demo` depends on it).
SERVER_PYTHON = {"mem0": ".venv-mem0/bin/python"}
# Tools that need more than text=hello in the demo.
TOOL_CALLS = {
    "mem0__add_memory": 'call mem0__add_memory {"thinking": "a wish", "content": ["The user likes short replies."]}',
    "mem0__search_memory": 'call mem0__search_memory keywords=["replies"]',
    "world_clock__time_in": "call world_clock__time_in timezone=Asia/Tokyo",
}


def host_models() -> dict[str, Any]:
    """The host's model registry: the embedded default ("offline") with two more rules (a text
    answer that quotes the system prompt, a failure), and "backup" for the fallback middleware."""
    from agent_host.config import DEFAULT_MODELS

    models = copy.deepcopy(DEFAULT_MODELS)
    models["models"]["offline"]["rules"] += [
        {
            "pattern": r"what do you know about (today|now)\b",
            "text": "Here is what I know about {0}, from my system prompt:\n{system}",
        },
        {"pattern": r"simulate an? (?:outage|failure)", "error": {"type": "upstream", "message": OUTAGE}},
        # A model that would call the tool at every step (until max_iters): the budget stops it.
        {
            "pattern": r"keep watching the forecast for (\w+)",
            "tool": "get_weather",
            "input": {"city": "{0}"},
            "repeat": True,
        },
        {"pattern": r"what(?:'s| is) my favou?rite (\w+)", "text": "Your favourite {0}, from memory:\n{hints}"},
    ]
    models["models"]["backup"] = {
        "provider": "offline",
        "reply_template": "This is the backup model: the primary one failed, so I answer instead. You said: {text}",
    }
    return models


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    what: str
    python: str | None = None  # another interpreter than this one (a venv of its own)


def discover_servers() -> list[ServerSpec]:
    """Every middleware server in mw_servers/: built-in packages, then example classes."""
    import mw_servers
    from agentmw.middleware import MiddlewareBase

    specs: list[ServerSpec] = []
    address = ["--address", "127.0.0.1:{port}"]
    for info in pkgutil.iter_modules(mw_servers.__path__):
        path = Path(mw_servers.__path__[0]) / info.name
        if info.ispkg and info.name not in ("sdk", "examples") and (path / "__main__.py").exists():
            flags = PACKAGE_ARGS.get(info.name, [])
            argv = ["-m", f"mw_servers.{info.name}", *address, *flags]
            python = str(ROOT / SERVER_PYTHON[info.name]) if info.name in SERVER_PYTHON else None
            if python is not None and not Path(python).exists():
                print(f"agentmw demo: skipping mw_servers.{info.name}: {python} is missing (make demo builds it)")
                continue
            specs.append(ServerSpec(info.name, argv, " ".join([f"mw_servers.{info.name}", *flags]), python))
    try:
        examples = importlib.import_module("mw_servers.examples")
    except ImportError:
        return specs
    for info in pkgutil.iter_modules(examples.__path__):
        module = importlib.import_module(f"mw_servers.examples.{info.name}")
        classes = [
            c
            for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, MiddlewareBase) and c is not MiddlewareBase and c.__module__ == module.__name__
        ]
        for cls in classes:
            name = info.name if len(classes) == 1 else f"{info.name}_{cls.__name__.lower()}"
            kwargs = SERVER_ARGS.get(cls.__name__, {})
            args = [f"--arg={k}={json.dumps(v)}" for k, v in kwargs.items()]
            target = f"{module.__name__}:{cls.__name__}"
            what = " ".join([target, *(f"{k}={v}" for k, v in kwargs.items())])
            specs.append(ServerSpec(name, ["-m", "agentmw.sdk", target, *address, *args], what))
    return specs


# ---------------------------------------------------------------------------------------------
# The conversation.


@dataclass
class Step:
    title: str
    message: str
    edit: dict[str, Any] | None = None  # confirmed calls get this input merged in
    external: str = "shipped on Monday, arrives Thursday"
    new_session: bool = False  # in a session of its own (the main session goes on after it)


@dataclass
class Outcome:
    failures: list[str] = field(default_factory=list)


def _steps(tools: list[str]) -> list[Step]:
    steps = [
        Step("a tool call", "What's the weather in Paris?"),
        Step(
            "human in the loop: the email needs a confirmation; the demo allows it and edits the body",
            "Please email bob@example.com saying hello from Paris",
            edit={"body": "Hello from Paris! (edited by the demo before sending)"},
        ),
        Step("external execution: the client runs lookup_order and sends back its result", "Where is my order A-1001?"),
        Step(
            "a token budget: the model would call get_weather at every step; after 3 weighted tokens the "
            "budget server withholds the tools and the agent answers",
            BUDGET_STEP,
        ),
    ]
    for name in tools:
        steps.append(
            Step(f"a tool contributed by a middleware: {name}", TOOL_CALLS.get(name, f"call {name} text=hello"))
        )
    if any(name.startswith("mem0__") for name in tools):
        steps += [
            Step("long-term memory: a fact told in a new session", "My favourite colour is teal.", new_session=True),
            Step("... recalled in another new session (mem0's hint)", "What is my favourite colour?", new_session=True),
        ]
    steps += [
        Step("the dynamic system prompt: the model answers from it", "What do you know about today?"),
        Step(
            "a model outage: the default model fails, the fallback middleware switches to backup",
            "Please simulate an outage",
        ),
        Step("a second turn on the same session", "Thanks! Now use add a=2 b=40"),
    ]
    return steps


def model_calls(view: Any) -> Any:
    """``view.show`` plus one line per model call: which model was asked and which answered."""
    from agentmw.data import ModelCallEndEvent, ModelCallStartEvent

    asked = {"model": ""}

    def show(item: Any) -> None:
        view.show(item)
        if isinstance(item, ModelCallStartEvent):
            asked["model"] = item.model_name
        elif isinstance(item, ModelCallEndEvent):
            used = item.metadata.get("model", "?")
            first = asked["model"] or used
            who = used if used == first else f"{first} failed, {used} answered"
            view._line(f"  · model call: {who} ({item.input_tokens} tokens in, {item.output_tokens} out)")

    return show


async def converse_demo(address: str, out: Any = sys.stdout) -> Outcome:
    from agentmw.codec import codec
    from agentmw.data import ReplyFinishedReason, ToolCallBlock, ToolResultBlock, ToolResultState, UserMsg
    from agentmw.data.events import ConfirmResult
    from agentmw.v1 import host_pb2

    from .chat_view import View
    from .host_client import HostClient, converse

    outcome = Outcome()
    # A directory of this run's own: a fixed shared one was another user's (unwritable) or another
    # demo's (overwritten) at the same time. It outlives the run, so the files can be played after.
    view = View(out=out, audio_dir=tempfile.mkdtemp(prefix="agentmw-demo-audio-"), color=False)
    async with HostClient(address) as client:
        attached = (await client.stub.ListMiddleware(host_pb2.ListMiddlewareRequest(), timeout=10)).middleware
        print("\nattached middleware (outermost first):", file=out)
        for mw in attached:
            tools = f"; tools: {', '.join(mw.tools)}" if mw.tools else ""
            print(f"  {mw.name:<16} {mw.address:<22} hooks: {', '.join(mw.hooks) or '-'}{tools}", file=out)
        show = model_calls(view)
        session = ""
        for i, step in enumerate(_steps([t for mw in attached for t in mw.tools]), 1):
            print(f"\n── {i}. {step.title}\n[you] {step.message}", file=out)

            async def confirm(call: ToolCallBlock, step: Step = step) -> ConfirmResult:
                edited = json.dumps({**json.loads(call.input or "{}"), **(step.edit or {})})
                call = ToolCallBlock(id=call.id, name=call.name, state=call.state, input=edited)
                print(f"  ! the demo allows {call.name}" + (f" with input {edited}" if step.edit else ""), file=out)
                return ConfirmResult(confirmed=True, tool_call=call)

            async def external(call: ToolCallBlock, step: Step = step) -> ToolResultBlock:
                print(f"  ! the demo runs {call.name}({call.input}) itself: {step.external!r}", file=out)
                return ToolResultBlock(id=call.id, name=call.name, output=step.external, state=ToolResultState.SUCCESS)

            turn = await converse(
                client,
                "" if step.new_session else session,
                UserMsg(step.message),
                on_item=show,
                on_confirm=confirm,
                on_external=external,
            )
            session = session if step.new_session else turn.session_id
            reason = turn.end.finished_reason if turn.end is not None else None
            if reason != ReplyFinishedReason.COMPLETED:
                outcome.failures.append(f"step {i} ({step.title}) ended {reason or 'parked'}")
        if view.saved:  # the TTS server (mw_servers/tts) spoke every text block
            where = f"{len(view.saved)} WAV files in {view.audio_dir}"
            print(f"\n── speech (the tts server): {where}; play one: aplay {view.saved[-1]}", file=out)
        else:
            with contextlib.suppress(OSError):  # nothing spoke: leave no empty directory behind
                view.audio_dir.rmdir()
        info = await client.stub.GetSession(host_pb2.GetSessionRequest(session_id=session), timeout=10)
        state = codec.decode(info.state)
        print(f"\n── the session {session}, as the host persisted it", file=out)
        print(
            f"  {len(state.context)} messages; {len(state.permission_rules)} permission rules; "
            f"pending tool calls: {len(info.pending_tool_calls)}",
            file=out,
        )
        slots = json.loads(info.middle_context_json)
        print("  what each middleware kept in its slot (middle_context[key]):", file=out)
        for mw in attached:
            kept = json.dumps(slots.pop(mw.key), sort_keys=True)[:300] if mw.key in slots else "nothing"
            print(f"    {mw.name:<16} [{mw.key}]: {kept}", file=out)
        for key, value in slots.items():  # slots of middleware no longer attached
            print(f"    {'':<16} [{key}]: {json.dumps(value, sort_keys=True)[:300]}", file=out)
    return outcome


# ---------------------------------------------------------------------------------------------
# Main.


def print_traces(receiver: Receiver, out: Any) -> None:
    """Each reply's trace (host, tracing server), oldest first; the processes have flushed by now."""
    traces = sorted(receiver.collector.traces().values(), key=lambda spans: min(s["start_ns"] for s in spans))
    print(f"\n── the traces of the conversation ({len(traces)}; one per Reply call, all processes)", file=out)
    for spans in traces:
        print(format_trace(spans), file=out)


def run(out: Any = sys.stdout) -> int:
    procs: list[ServerProcess] = []
    receiver = Receiver().start()  # the processes export their spans here (OTLP/gRPC)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with tempfile.TemporaryDirectory(prefix="agentmw-demo-") as tmp:
        log_dir = Path(tmp)

        def process(name: str, argv: list[str], python: str | None = None) -> ServerProcess:
            # A session of its own: a Ctrl-C in the terminal reaches only the demo, which stops it.
            argv = [a.replace("{tmp}", tmp) for a in argv]
            proc = ServerProcess(argv, name=name, env=env, log_dir=log_dir, new_session=True, executable=python)
            proc.startup = 120  # at most: the mem0 server loads an embedding model first
            procs.append(proc)
            return proc

        try:
            specs = discover_servers()
            print(f"agentmw demo: starting {len(specs)} middleware servers and the host (logs in {log_dir})", file=out)
            start_all([process(spec.name, spec.argv, spec.python) for spec in specs])
            flags = []
            for spec, proc in zip(specs, procs, strict=True):
                print(f"  middleware {spec.name:<16} {proc.address:<22} ({spec.what})", file=out)
                flags += ["--middleware", f"{spec.name}={proc.address}"]
            db = str(log_dir / "sessions.db")
            config = log_dir / "host.yaml"
            config.write_text(yaml.safe_dump({"models": host_models()}, sort_keys=False))
            host = ["-m", "agent_host", "--config", str(config), "--listen", "127.0.0.1:0", "--db", db]
            address = process("host", [*host, "--log-level", "warning", *flags]).start().address
            print(
                f"  agent host            {address:<22} (offline models: offline, backup; sessions in SQLite)", file=out
            )
            outcome = asyncio.run(converse_demo(address, out))
        except KeyboardInterrupt:
            print("\nagentmw demo: interrupted", file=out)
            return 130
        except Exception as exc:
            print(f"\nagentmw demo: FAILED: {type(exc).__name__}: {exc}", file=out)
            if not isinstance(exc, LaunchError):  # a LaunchError carries the output already
                for proc in procs:
                    if proc.died:
                        print(f"  {proc.name} exited with {proc.returncode}; its output:\n{proc.tail()}", file=out)
            return 1
        finally:
            for proc in reversed(procs):
                proc.stop()  # a stopping process sends the spans it still holds
            receiver.stop()
    print_traces(receiver, out)
    if outcome.failures:
        print("\nagentmw demo: FAILED: " + "; ".join(outcome.failures), file=out)
        return 1
    print("\nagentmw demo: OK (every reply completed; all processes stopped)", file=out)
    return 0


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the demo like Ctrl-C, so its children are stopped too


def main(argv: list[str] | None = None) -> int:
    # No options: --help says what it does, rather than starting it.
    parser = argparse.ArgumentParser(
        prog="python -m clients.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    return run()


if __name__ == "__main__":
    sys.exit(main())
