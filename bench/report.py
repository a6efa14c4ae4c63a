"""BENCHMARKS.md: the ratios against the targets first, then the absolute values for context."""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from . import four_servers, versus
from .builtins import FLOOR, PACE, TTS_TEXT
from .echo_server import SPIN
from .harness import Series, pace_label, per_round, ratio, spread
from .hosts import HostsResult
from .hosts import section as hosts_section
from .optimizations import OPTIMIZATION_HEADER, optimization_rows
from .python_cost import PythonCost
from .scenarios import BYPASS_N, CONCURRENT, IDLE, ITEMS, Protocol, ReplyTraffic, Unimplemented

FAIR_FRACTION = 0.5  # our reading of "a fraction of AgentScope's" time to first text


@dataclass
class Results:
    rounds: int
    env_start: dict[str, str] = field(default_factory=dict)
    env_end: dict[str, str] = field(default_factory=dict)
    protocol: Protocol | None = None
    calls: dict[str, Series] = field(default_factory=dict)
    calls_uvloop: dict[str, Series] | None = None  # 1-3 again, everything on uvloop (None: not installed)
    bypass: dict[str, Series] = field(default_factory=dict)
    unimplemented: Unimplemented | None = None
    traffic: ReplyTraffic | None = None
    replies: dict[str, Series] = field(default_factory=dict)
    fairness: dict[str, Series] = field(default_factory=dict)
    peer_ok: bool = False  # the AgentScope peer ran, and its variants are in bypass/replies/fairness
    peer_note: str = ""
    builtins: dict[str, dict[str, Series]] = field(default_factory=dict)  # builtin -> variant -> series
    builtin_notes: dict[str, str] = field(default_factory=dict)  # builtin -> why it is not measured
    spans_exported: int = 0  # by the tracing server, counted by the OTLP receiver
    hosts: HostsResult | None = None  # bench/hosts.py: replies/s of hosts on PostgreSQL vs SQLite
    four: four_servers.FourResults | None = None  # the four servers vs AgentScope (section 9)
    python_cost: PythonCost | None = None  # per-item CPU of host and SDK above the peer, no I/O (3)
    versus: versus.VersusResult | None = None  # this tree against the one before isolation (section 10)
    idle: dict[str, Series] = field(default_factory=dict)  # 1b hot and after a paced model's wait (scenarios)
    duration: float = 0.0


def environment() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return {
        "cpus": f"{os.cpu_count()} (usable by this process: {len(os.sched_getaffinity(0))})",
        "cpu model": cpu_model or "unknown",
        "python": sys.version.split()[0] + f" ({platform.python_implementation()})",
        "grpcio": version("grpcio"),
        "protobuf": version("protobuf"),
        "platform": platform.platform(),
        "load average": load,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


# -- formatting ----------------------------------------------------------------------------------------


def us(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e6:,.1f} µs"


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:,.1f} ms"


def times(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}x"


def iqr(values: Sequence[float], unit: Any = us) -> str:
    lo, hi = spread(values)
    return f"{unit(lo)} .. {unit(hi)}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


# -- derived figures -----------------------------------------------------------------------------------


@dataclass
class Figures:
    hook_ratio: float
    compress_ratio: float
    eager_ratio: float
    done_ratio: float
    hook_floor_ratio: float  # the 2-exchange bare stream over the 1-exchange one: the protocol's floor
    hook_over_floor: float  # the hook over the 2-exchange bare stream
    reused_estimate: float  # 2 ping-pongs on an open stream over 1a: a pass-through on a reused stream
    bypass1: list[float]  # per round, CPU seconds per bypassed item per layer, 1 layer
    bypass1_wall: list[float]  # the same in wall seconds
    bypass4: list[float]  # 4 layers
    bypass4_wall: list[float]
    inproc_layer: list[float]  # per round, seconds per item per in-process pass-through layer
    unimpl_cost: list[float]  # per round, seconds per hook call, attached minus none


@dataclass
class Intercept:
    """The intercepted-item figures of one run of 1-3 (asyncio's loop or uvloop), per round."""

    item: list[float]  # seconds per intercepted item: (stream - none) / ITEMS
    ahead: list[float]  # the same, run_ahead
    floor: list[float]  # the minimal protobuf peer, the same exchanges: per item
    floor_ahead: list[float]
    floor_ahead_spun: list[float]  # the peer, run_ahead, with SPIN seconds of busy work per item on each side
    host_half: list[float]  # the real host against the peer's middleware side: (stream - none) / ITEMS
    sdk_half: list[float]  # the peer's host side against the real SDK: per item
    host_half_ahead: list[float]  # the same two, run_ahead on both sides
    sdk_half_ahead: list[float]
    pingpong: list[float]  # 1b
    round_trips: int  # per item, lock-step (2) and run_ahead (1)
    round_trips_ahead: int

    def over_floor(self, ahead: bool = False, mine: list[float] | None = None) -> float:
        """``mine`` (default: agentmw's item, or its run_ahead one) over the protobuf peer's."""
        floor = self.floor_ahead if ahead else self.floor
        mine = mine if mine is not None else self.ahead if ahead else self.item
        return statistics.median(a / b for a, b in zip(mine, floor, strict=True))

    def per_round_trip(self, values: list[float], ahead: bool = False) -> list[float]:
        return [v / (self.round_trips_ahead if ahead else self.round_trips) for v in values]

    def rt_over_pingpong(self, values: list[float], ahead: bool = False) -> float:
        rts = self.per_round_trip(values, ahead)
        return statistics.median(a / b for a, b in zip(rts, self.pingpong, strict=True))


def intercept(c: dict[str, Series], p: Protocol) -> Intercept:
    none = c["stream_none"].walls

    def per_item(key: str) -> list[float]:
        return per_round(c[key].walls, none, lambda a, z: (a - z) / ITEMS)

    return Intercept(
        item=per_item("stream_intercept"),
        ahead=per_item("stream_intercept_ahead"),
        floor=[w / ITEMS for w in c["floor_intercept"].walls],
        floor_ahead=[w / ITEMS for w in c["floor_intercept_ahead"].walls],
        floor_ahead_spun=[w / ITEMS for w in c["floor_intercept_ahead_spun"].walls],
        host_half=per_item("host_half"),
        sdk_half=[w / ITEMS for w in c["sdk_half"].walls],
        host_half_ahead=per_item("host_half_ahead"),
        sdk_half_ahead=[w / ITEMS for w in c["sdk_half_ahead"].walls],
        pingpong=c["bare_pingpong"].walls,
        round_trips=p.round_trips,
        round_trips_ahead=p.round_trips_ahead,
    )


def derive(r: Results) -> Figures:
    c, b = r.calls, r.bypass

    def slope(key: str, layers: int, wall: bool = False) -> list[float]:
        get = (lambda s: s.walls) if wall else (lambda s: s.cpus)
        mw_n, mw_0 = get(b[f"{key}_n"]), get(b[f"{key}_0"])
        none_n, none_0 = get(b["none_n"]), get(b["none_0"])
        return [
            ((a - z) - (n - o)) / (BYPASS_N * layers) for a, z, n, o in zip(mw_n, mw_0, none_n, none_0, strict=True)
        ]

    inproc = per_round(b["inproc4_n"].walls, b["none_n"].walls, lambda a, z: (a - z) / (BYPASS_N * 4))
    u = r.unimplemented
    assert u is not None
    unimpl = per_round(u.cost["attached"].walls, u.cost["none"].walls, lambda a, z: (a - z) / 2)
    return Figures(
        hook_ratio=ratio(c["hook_permission"].walls, c["bare_exchange"].walls),
        compress_ratio=ratio(c["hook_compress"].walls, c["bare_exchange"].walls),
        eager_ratio=ratio(c["hook_permission_eager"].walls, c["bare_exchange"].walls),
        done_ratio=ratio(c["hook_permission_done"].walls, c["bare_exchange"].walls),
        hook_floor_ratio=ratio(c["bare_two"].walls, c["bare_exchange"].walls),
        hook_over_floor=ratio(c["hook_permission"].walls, c["bare_two"].walls),
        reused_estimate=ratio([2 * w for w in c["bare_pingpong"].walls], c["bare_exchange"].walls),
        bypass1=slope("end1", 1),
        bypass1_wall=slope("end1", 1, wall=True),
        bypass4=slope("end4", 4),
        bypass4_wall=slope("end4", 4, wall=True),
        inproc_layer=inproc,
        unimpl_cost=unimpl,
    )


# -- the document --------------------------------------------------------------------------------------


ABSOLUTE_HEADER = ["what", "wall per op", "IQR over rounds", "host CPU per op", "server CPU per op"]
REPLY_HEADER = ["variant", "host CPU (process_time)", "IQR", "time to first text", "reply wall", "middleware CPU"]
FAIRNESS_HEADER = ["variant", "median time to first text", "median reply end", "host CPU per reply"]
TRAFFIC_HEADER = ["case", "streams", "host → middleware messages", "middleware → host messages", "bytes out / in"]


def render(r: Results) -> str:
    f = derive(r)
    return "\n".join(
        [
            "# Benchmarks",
            "",
            "Generated by `make bench` (`python -m bench.run`); do not edit by hand. Middleware servers and the "
            "bare echo server run as separate processes on 127.0.0.1; this process is the host. Compared variants "
            f"run interleaved, {r.rounds} rounds (order rotating each round, one warm-up round discarded); each "
            "figure is the median over rounds, each ratio the median of the per-round ratios. A timed stream of "
            "intercepted items (3) follows an untimed one on the same stream, for agentmw as for the floors: this "
            "machine's processes wake slowly after they idled (while other variants ran), and that first "
            "stretch would otherwise count against one side only. The machine is shared and noisy: read the "
            "ratios, and the absolute values only as context.",
            "",
            "## Environment",
            "",
            table(["", ""], _environment_rows(r)),
            "",
            "## Targets (ratios measured in this run)",
            "",
            table(["what", "measured", "target", "verdict"], _target_rows(r, f)),
            "",
            "## Absolute values (context only; medians, this machine, this run)",
            "",
            table(ABSOLUTE_HEADER, _absolute_rows(r, f)),
            "",
            "### 1-3 on uvloop (host, echo, floors and middleware servers all on uvloop; a second process)",
            "",
            table(ABSOLUTE_HEADER, _uvloop_rows(r)),
            "",
            "### Optimizations (before / after, measured side by side; see bench/optimizations.py)",
            "",
            table(OPTIMIZATION_HEADER, optimization_rows() + _uvloop_optimization_rows(r)),
            "",
            "### Whole replies: 3 tool rounds + 1,000 text deltas (OfflineRuleModel script)",
            "",
            table(REPLY_HEADER, _reply_rows(r)),
            "",
            "### Built-in servers attached remotely (one process per server; each against its own baseline)",
            "",
            table(BUILTIN_HEADER, builtin_rows(r.builtins, r.spans_exported)),
            "",
            hosts_section(r.hosts),
            "",
            "### The four built-in servers vs AgentScope 2.0.11's own four (3 tool rounds + 1,000 deltas)",
            "",
            table(four_servers.HEADER, four_servers.absolute_rows(r.four)) if r.four else "not measured",
            "",
            four_servers.notes(r.four) if r.four else "",
            "",
            versus.section(r.versus),
            "",
            f"### Fairness: {CONCURRENT} concurrent replies of 1,000 deltas, instant model",
            "",
            table(FAIRNESS_HEADER, _fairness_rows(r)),
            "",
            "### Protocol traffic (in the first two rows each middleware → host message is a round trip)",
            "",
            table(TRAFFIC_HEADER, _traffic_rows(r)),
            "",
            _server_side(r),
            "",
            "## Method",
            "",
            *METHOD,
            "",
        ]
    )


def _environment_rows(r: Results) -> list[list[str]]:
    return [[k, v] for k, v in r.env_start.items()] + [
        ["load average at the end", r.env_end.get("load average", "?")],
        ["run time", f"{r.duration:.0f} s"],
        ["AgentScope peer", r.peer_note],
    ]


def _target_rows(r: Results, f: Figures) -> list[list[str]]:
    u = r.unimplemented
    assert u is not None
    rep = r.replies
    other_streams = sum(n for hook, n in u.streams_by_hook.items() if hook != "on_reply")
    other_calls = sum(n for hook, n in u.server_calls.items() if hook != "on_reply")
    bypass_msgs = u.messages_per_reply[BYPASS_N] - u.messages_per_reply[0]
    bypass_layer = statistics.median(f.bypass4)
    unimpl = statistics.median(f.unimpl_cost)
    rows = [
        [
            "Hook a middleware does not implement: RPCs during a full reply (6 hooks not implemented)",
            f"{other_streams} streams opened (host), {other_calls} invocations (server)",
            "0",
            verdict(other_streams == 0 and other_calls == 0),
        ],
        ["…and its host cost per hook call (attached - none)", us(unimpl), "≈ 0", verdict(abs(unimpl) < 1e-6)],
        [
            f"Unsubscribed item: extra messages, {BYPASS_N:,}-delta reply vs 0-delta",
            str(bypass_msgs),
            "0",
            verdict(bypass_msgs == 0),
        ],
        [
            "Unsubscribed item: host CPU per item per layer (4 layers)",
            us(bypass_layer),
            "< 2 µs",
            verdict(bypass_layer < 2e-6),
        ],
        [
            "One remote hook invocation (on_check_permission pass-through) / bare new-stream exchange (1a)",
            times(f.hook_ratio),
            "≤ 1.25x",
            verdict(f.hook_ratio <= 1.25),
        ],
        [
            "…on_compress_context pass-through / 1a",
            times(f.compress_ratio),
            "≤ 1.25x",
            verdict(f.compress_ratio <= 1.25),
        ],
        [
            "…on_check_permission pass-through declared eager_next (one round trip) / 1a",
            times(f.eager_ratio),
            "≤ 1.25x",
            verdict(f.eager_ratio <= 1.25),
        ],
        [
            "…on_check_permission pass-through declared done_with_inner (one round trip) / 1a",
            times(f.done_ratio),
            "≤ 1.25x",
            verdict(f.done_ratio <= 1.25),
        ],
        [
            "…context: the floor of 2 round trips on a new stream (1c) / 1a; the hook / 1c",
            f"{times(f.hook_floor_ratio)}; {times(f.hook_over_floor)}",
            "—",
            "—",
        ],
        [
            "…context: 2 round trips on an already-open stream (2 x 1b) / 1a, i.e. a pass-through on a reused stream",
            times(f.reused_estimate),
            "—",
            "—",
        ],
        [
            "…context: the hook / the minimal protobuf peer's value-hook exchange on an open stream (same messages)",
            times(ratio(r.calls["hook_permission"].walls, r.calls["floor_hook"].walls)),
            "—",
            "—",
        ],
    ]
    rows += _intercept_rows(r, r.calls, "")
    if r.calls_uvloop is not None:
        uv = r.calls_uvloop
        hook_uv = ratio(uv["hook_permission"].walls, uv["bare_exchange"].walls)
        rows.append(["On uvloop (host, servers and floors): one remote hook invocation / 1a", times(hook_uv), "—", "—"])
        rows += _intercept_rows(r, uv, "On uvloop: ")
    else:
        rows.append(["Intercepted item on uvloop", "uvloop is not installed", "≤ 1.25x", "n/a"])
    if r.peer_ok:
        rows += _peer_rows(r)
    else:
        rows.append(["AgentScope peer targets (CPU ≤ 1.5x, first text ≤ +5 ms, fairness)", r.peer_note, "—", "n/a"])
    rows.append(
        [
            "Reply host CPU: 1 remote middleware (4 hooks) / no middleware (this host; no target)",
            times(ratio(rep["remote"].cpus, rep["none"].cpus)),
            "—",
            "—",
        ]
    )
    rows.append(
        [
            "Reply host CPU and time to reply end: budget server / the same class in-process (no target)",
            f"{times(ratio(rep['budget_remote'].cpus, rep['budget_inproc'].cpus))}; "
            f"{times(ratio(rep['budget_remote'].walls, rep['budget_inproc'].walls))}",
            "—",
            "—",
        ]
    )
    rows += builtin_targets(r.builtins, r.builtin_notes)
    return rows + (four_servers.target_rows(r.four) if r.four else []) + idle_rows(r) + versus.target_rows(r.versus)


def idle_rows(r: Results) -> list[list[str]]:
    """Context for the paced time to first text: what waking a process that slept costs."""
    if not r.idle:
        return []
    hot, idle = (statistics.median(r.idle[k].walls) for k in ("hot", "idle"))
    return [
        [
            f"…context: one round trip on an open stream (1b) after {IDLE * 1e3:.0f} ms with nothing "
            "to do / right after another (what a process that went to sleep costs to wake; a paced remote reply "
            "waits on 4 such round trips before its first text: mem0's ReplyStartEvent and budget's "
            "ModelCallEndEvent after each of the 3 tool-calling model calls, where AgentScope's in-process "
            "middleware pay none)",
            f"{ms(idle)} / {us(hot)} ({times(idle / hot)})",
            "—",
            "—",
        ]
    ]


def _python_cost(r: Results, uvloop: bool) -> str:
    """agentmw's own per-item CPU above the peer on each side (bench/python_cost.py), if measured."""
    if r.python_cost is None or uvloop:
        return ""
    host, sdk = r.python_cost.above()
    return (
        f"; agentmw's own per-item work above the peer, measured without I/O (bench/python_cost.py): "
        f"host {host:.1f} µs, SDK {sdk:.1f} µs"
    )


def _intercept_rows(r: Results, c: dict[str, Series], prefix: str) -> list[list[str]]:
    """Intercepted item against both floors: the minimal protobuf peer doing the same exchanges
    (per item), and the raw-bytes ping-pong (per round trip: the protocol's lock-step takes two)."""
    assert r.protocol is not None
    x = intercept(c, r.protocol)
    over_pb, over_pb_ahead = x.over_floor(), x.over_floor(ahead=True)
    rt, rt_ahead = x.rt_over_pingpong(x.item), x.rt_over_pingpong(x.ahead, ahead=True)
    uv = bool(prefix)
    return [
        [
            f"{prefix}One intercepted item (on_reply pass-through, default lock-step: {x.round_trips} round trips) / "
            "the minimal protobuf peer exchanging the same messages",
            times(over_pb),
            "≤ 1.25x",
            verdict(over_pb <= 1.25),
        ],
        [
            f"{prefix}…per round trip / bare ping-pong on an open stream (1b); the protobuf peer's per round trip / 1b",
            f"{times(rt)}; {times(x.rt_over_pingpong(x.floor))}",
            "≤ 1.25x with uvloop" if uv else "—",
            verdict(rt <= 1.25) if uv else "—",
        ],
        [
            f"{prefix}…where the time goes: the real host against the peer's middleware side / the peer; the "
            "peer's host side against the real SDK / the peer",
            f"{times(x.over_floor(mine=x.host_half))}; {times(x.over_floor(mine=x.sdk_half))}",
            "—",
            "—",
        ],
        [
            f"{prefix}…the same middleware declaring run_ahead ({x.round_trips_ahead} round trip) / the protobuf "
            "peer's run_ahead exchange",
            times(over_pb_ahead),
            "≤ 1.25x",
            verdict(over_pb_ahead <= 1.25),
        ],
        [
            f"{prefix}…run_ahead, where the time goes: the real host against the peer's run_ahead middleware "
            "side / the peer; the peer's host side against the real SDK (run_ahead) / the peer",
            f"{times(x.over_floor(ahead=True, mine=x.host_half_ahead))}; "
            f"{times(x.over_floor(ahead=True, mine=x.sdk_half_ahead))}",
            "—",
            "—",
        ],
        [
            f"{prefix}…context: the protobuf peer with {SPIN * 1e6:g} µs more CPU per item on each side / the peer "
            f"(run_ahead): what that much per-item work costs end to end on this machine{_python_cost(r, uv)}",
            times(x.over_floor(ahead=True, mine=x.floor_ahead_spun)),
            "—",
            "—",
        ],
        [
            f"{prefix}…run_ahead per round trip / 1b; the protobuf peer's / 1b",
            f"{times(rt_ahead)}; {times(x.rt_over_pingpong(x.floor_ahead, ahead=True))}",
            "≤ 1.25x with uvloop" if uv else "—",
            verdict(rt_ahead <= 1.25) if uv else "—",
        ],
    ]


def _peer_rows(r: Results) -> list[list[str]]:
    """The targets against AgentScope 2.0.11 in-process. The four built-ins are not servers yet, so
    pass-through middleware with their kind of subscriptions stand in for them: one remote
    middleware on four hooks (a lower bound) and four of them (an upper bound: the built-ins
    implement fewer hooks each), against the same number of in-process pass-throughs."""
    rep, fair = r.replies, r.fairness
    rows = []
    for key, peer_key, label in (("remote", "peer_mw", "1 middleware"), ("remote4", "peer_mw4", "4 middleware")):
        cpu = ratio(rep[key].cpus, rep[peer_key].cpus)
        ttft = statistics.median(per_round(rep[key].firsts, rep[peer_key].firsts, lambda a, b: a - b))
        rows += [
            [
                f"Reply host CPU, 3 tool rounds + 1,000 deltas: {label} (4 hooks each) remote / AgentScope with "
                f"{label} in-process",
                times(cpu),
                "≤ 1.5x",
                verdict(cpu <= 1.5),
            ],
            [
                f"Time to first text, same reply, {label}: remote - AgentScope in-process",
                ms(ttft),
                "≤ +5 ms",
                verdict(ttft <= 0.005),
            ],
        ]
    for key, label in (
        ("none", "no middleware"),
        ("remote", "1 remote middleware"),
        ("none_yielding", "no middleware + fix prototype"),
    ):
        frac = ratio(fair[key].firsts, fair["peer"].firsts)
        rows.append(
            [
                f"Median time to first text, {CONCURRENT} concurrent replies, {label} / AgentScope's (no middleware)",
                times(frac),
                f"a fraction (≤ {FAIR_FRACTION}x)",
                verdict(frac <= FAIR_FRACTION),
            ]
        )
    return rows


def _item_rows(r: Results, c: dict[str, Series]) -> list[list[str]]:
    """Per intercepted item (and per round trip) of agentmw and of the minimal protobuf peer."""
    assert r.protocol is not None
    x = intercept(c, r.protocol)
    none = c["stream_none"]
    rows = []
    for key, values, ahead, label in (
        ("stream_intercept", x.item, False, "agentmw, lock-step: (with - without)"),
        ("stream_intercept_ahead", x.ahead, True, "agentmw, run_ahead: (with - without)"),
        ("floor_intercept", x.floor, False, "the minimal protobuf peer, lock-step"),
        ("floor_intercept_ahead", x.floor_ahead, True, "the minimal protobuf peer, run_ahead"),
        ("host_half", x.host_half, False, "the real host, the peer's middleware side: (with - without)"),
        ("sdk_half", x.sdk_half, False, "the peer's host side, the real SDK"),
        ("host_half_ahead", x.host_half_ahead, True, "run_ahead, the real host, the peer's middleware side"),
        ("sdk_half_ahead", x.sdk_half_ahead, True, "run_ahead, the peer's host side, the real SDK"),
    ):
        s = c[key]
        agentmw = key.startswith(("stream", "host_half"))
        cpu = per_round(s.cpus, none.cpus, lambda a, z: a - z) if agentmw else s.cpus
        rts = x.round_trips_ahead if ahead else x.round_trips
        rows.append(
            [
                f"3 intercepted item, {label} / {ITEMS}; per round trip ({rts} per item)",
                f"{us(statistics.median(values))}; {us(statistics.median(x.per_round_trip(values, ahead)))}",
                iqr(values),
                us(statistics.median(cpu) / ITEMS),
                us(s.server_cpu / ITEMS),
            ]
        )
    return rows


def _uvloop_optimization_rows(r: Results) -> list[list[str]]:
    """uvloop on / off, from this run (asyncio's loop: before; uvloop: after)."""
    if r.calls_uvloop is None or r.protocol is None:
        return []
    a, u = intercept(r.calls, r.protocol), intercept(r.calls_uvloop, r.protocol)
    change = "uvloop for the host, the middleware servers and the floors (loop: uvloop), this run"

    def hook(c: dict[str, Series]) -> float:
        return ratio(c["hook_permission"].walls, c["bare_exchange"].walls)

    return [
        [
            change,
            "this run",
            "intercepted item, per item",
            us(statistics.median(a.item)),
            us(statistics.median(u.item)),
        ],
        [
            change,
            "this run",
            "…per round trip / 1b (asyncio's 1b; uvloop's 1b)",
            times(a.rt_over_pingpong(a.item)),
            times(u.rt_over_pingpong(u.item)),
        ],
        [change, "this run", "…/ the protobuf peer on the same loop", times(a.over_floor()), times(u.over_floor())],
        [
            change,
            "this run",
            "one remote hook invocation",
            us(r.calls["hook_permission"].wall),
            us(r.calls_uvloop["hook_permission"].wall),
        ],
        [change, "this run", "…/ 1a on the same loop", times(hook(r.calls)), times(hook(r.calls_uvloop))],
    ]


def _uvloop_rows(r: Results) -> list[list[str]]:
    c = r.calls_uvloop
    if c is None:
        return [["uvloop is not installed", "", "", "", ""]]

    def row(label: str, s: Series) -> list[str]:
        return [label, us(s.wall), iqr(s.walls), us(s.cpu), us(s.server_cpu)]

    return [
        row("1a bare new-stream exchange", c["bare_exchange"]),
        row("1b bare ping-pong on an open stream", c["bare_pingpong"]),
        row("2 remote on_check_permission pass-through", c["hook_permission"]),
        row("2 floor: the minimal protobuf peer, a value-hook invocation on an open stream", c["floor_hook"]),
        *_item_rows(r, c),
    ]


def _absolute_rows(r: Results, f: Figures) -> list[list[str]]:
    def row(label: str, s: Series) -> list[str]:
        return [label, us(s.wall), iqr(s.walls), us(s.cpu), us(s.server_cpu)]

    c = r.calls
    rows = [
        row("1a bare new-stream exchange (write, read, half-close, status)", c["bare_exchange"]),
        row("1b bare ping-pong on an open stream", c["bare_pingpong"]),
        row("1c bare new stream with two exchanges (the floor of a value-hook pass-through)", c["bare_two"]),
        row("2 remote on_check_permission pass-through", c["hook_permission"]),
        row("2 remote on_compress_context pass-through", c["hook_compress"]),
        row("2 remote on_check_permission pass-through, eager_next", c["hook_permission_eager"]),
        row("2 remote on_check_permission pass-through, done_with_inner", c["hook_permission_done"]),
        row("2 floor: the minimal protobuf peer, a value-hook invocation on an open stream", c["floor_hook"]),
        *_item_rows(r, c),
        [
            "4 unsubscribed item per layer, 1 layer",
            us(statistics.median(f.bypass1_wall)),
            iqr(f.bypass1_wall),
            us(statistics.median(f.bypass1)),
            "—",
        ],
        [
            "4 unsubscribed item per layer, 4 layers",
            us(statistics.median(f.bypass4_wall)),
            iqr(f.bypass4_wall),
            us(statistics.median(f.bypass4)),
            "—",
        ],
        [
            "4 in-process pass-through on_reply layer, per item (same chain)",
            us(statistics.median(f.inproc_layer)),
            iqr(f.inproc_layer),
            "—",
            "—",
        ],
        [
            "4 unimplemented hook, host cost per hook call, attached - none",
            us(statistics.median(f.unimpl_cost)),
            iqr(f.unimpl_cost),
            "—",
            "—",
        ],
    ]
    if r.peer_ok:
        layer = r.bypass["peer_layer"]
        label = "AgentScope 2.0.11 in-process pass-through on_reply layer, per event (whole reply, 4 layers)"
        rows.append([label, us(layer.wall), iqr(layer.walls), "—", "—"])
    return rows


REPLY_VARIANTS = {
    "none": "no middleware",
    "remote": "1 remote Realistic middleware (4 hooks)",
    "remote4": "4 remote Realistic middleware (4 hooks each)",
    "none_yielding": "no middleware, model yields to the loop every 16 chunks (fix prototype)",
    "remote_yielding": "remote Realistic, model yields every 16 chunks (fix prototype)",
    "budget_remote": "budget server (mw_servers.budget: on_reply + on_reasoning), counting",
    "budget_inproc": "the same ReplyBudget class in-process, counting",
    "peer_none": "AgentScope 2.0.11 in-process, no middleware",
    "peer_mw": "AgentScope 2.0.11 in-process, 1 pass-through middleware (4 hooks)",
    "peer_mw4": "AgentScope 2.0.11 in-process, 4 pass-through middleware (4 hooks each)",
    "peer": "AgentScope 2.0.11 in-process, no middleware",
}


def _reply_rows(r: Results) -> list[list[str]]:
    return [
        [REPLY_VARIANTS[key], ms(s.cpu), iqr(s.cpus, ms), ms(s.first), ms(s.wall), ms(s.server_cpu)]
        for key, s in r.replies.items()
        if r.peer_ok or not key.startswith("peer")
    ]


# -- the built-in servers (bench/builtins.py) -----------------------------------------------------------

BUILTIN_HEADER = ["server, variant", "time to first text", "reply end", "host CPU per reply", "server CPU", "notes"]
BUILTIN_LABELS = {
    "tracing": "tracing (mw_servers.tracing, OTLP exporter; host not tracing), 3 tool rounds + 1,000 deltas",
    "tracing-paced": f"tracing, the same reply on a paced model ({pace_label(PACE)})",
    "tts": f"TTS (mw_servers.tts, espeak-ng), one text block of {len(TTS_TEXT.split())} words",
    "mem0": "mem0 (mw_servers.mem0, static mode, offline default), 1,000 deltas",
}


def _added(a: Series, none: Series) -> float:
    """Median over rounds of (attached - none) time to first text."""
    return statistics.median(per_round(a.firsts, none.firsts, lambda x, y: x - y))


def builtin_targets(builtins: dict[str, dict[str, Series]], notes: dict[str, str]) -> list[list[str]]:
    rows: list[list[str]] = []
    if "tracing" in builtins:
        s = builtins["tracing"]
        end = ratio(s["attached"].walls, s["none"].walls)
        rows += [
            [
                "Tracing server attached remotely (host not tracing), 3 tool rounds + 1,000 deltas: "
                "time to reply end / none",
                times(end),
                "≤ 1.05x",
                verdict(end <= 1.05),
            ],
            [
                "…its host CPU per reply, background copies included / none",
                times(ratio(s["attached"].cpus, s["none"].cpus)),
                "—",
                "—",
            ],
        ]
        if "in-process" in s:  # context: the span work in the host, as AgentScope's TracingMiddleware does it
            rows.append(
                [
                    "…context: the same TracingMiddleware in-process (a host process of its own that traces "
                    "its replies too; the same exporter): time to reply end / none; host CPU / none",
                    f"{times(ratio(s['in-process'].walls, s['none'].walls))}; "
                    f"{times(ratio(s['in-process'].cpus, s['none'].cpus))}",
                    "—",
                    "—",
                ]
            )
        if FLOOR in s:  # context: how much of the budget merely wrapping the same hooks takes
            rows.append(
                [
                    "…context: the least any middleware on the same three hooks costs, in-process "
                    "(bench/middlewares.py WatcherFloor: a generator per streamed item, nothing else): "
                    "time to reply end / none",
                    times(ratio(s[FLOOR].walls, s["none"].walls)),
                    "—",
                    "—",
                ]
            )
    if "tracing-paced" in builtins:  # the instant model above is the worst case: every µs is on the reply's path
        s = builtins["tracing-paced"]
        end = ratio(s["attached"].walls, s["none"].walls)
        what = f"…the same reply on a paced model ({pace_label(PACE)}): time to reply end / none"
        rows.append([what, times(end), "≤ 1.05x", verdict(end <= 1.05)])
    if "tts" in builtins:
        s = builtins["tts"]
        for variant in ("standard", "realtime"):
            added = _added(s[variant], s["none"])
            rows.append(
                [
                    f"TTS server attached ({variant} mode): time to first text - none",
                    ms(added),
                    "≤ +5 ms",
                    verdict(added <= 0.005),
                ]
            )
        rows.append(["…first audio after the text block ends (standard mode)", ms(s["standard"].mark), "—", "—"])
    if "mem0" in builtins:
        s = builtins["mem0"]
        rows.append(
            [
                "mem0 server attached (static mode): time to first text - none",
                ms(_added(s["attached"], s["none"])),
                "—",
                "—",
            ]
        )
    rows += [[f"{name} server", note, "—", "n/a"] for name, note in notes.items()]
    return rows


def builtin_rows(builtins: dict[str, dict[str, Series]], spans: int) -> list[list[str]]:
    rows = []
    for name, series in builtins.items():
        for variant, s in series.items():
            note = ""
            if variant != "none":
                note = f"reply end {times(ratio(s.walls, series['none'].walls))} of none"
            if name.startswith("tracing") and variant not in ("none", FLOOR):
                note += f"; {spans:,} spans exported in all"
            elif name == "tts" and variant != "none":
                note += (
                    f"; first audio {ms(s.mark)} after the block ends"
                    if variant == "standard"
                    else f"; first audio {ms(s.mark)} after the first text"
                )
            rows.append(
                [f"{BUILTIN_LABELS[name]}: {variant}", ms(s.first), ms(s.wall), ms(s.cpu), ms(s.server_cpu), note]
            )
    return rows


def builtin_section(builtins: dict[str, dict[str, Series]], notes: dict[str, str], spans: int, rounds: int) -> str:
    """What ``python -m bench.<server>`` prints: its target rows and its absolute values."""
    return "\n\n".join(
        [
            f"{rounds} interleaved rounds, medians; ratios and differences are medians of the per-round ones.",
            table(["what", "measured", "target", "verdict"], builtin_targets(builtins, notes)),
            table(BUILTIN_HEADER, builtin_rows(builtins, spans)),
        ]
    )


def _fairness_rows(r: Results) -> list[list[str]]:
    return [
        [REPLY_VARIANTS[key], ms(s.first), ms(s.wall), ms(s.cpu)]
        for key, s in r.fairness.items()
        if r.peer_ok or not key.startswith("peer")
    ]


def _traffic_rows(r: Results) -> list[list[str]]:
    p, u, t = r.protocol, r.unimplemented, r.traffic
    assert p is not None and u is not None and t is not None
    hook, item = p.hook, p.item
    return [
        [
            "one on_check_permission pass-through",
            f"{hook.streams}",
            f"{hook.writes}",
            f"{hook.reads}",
            f"{hook.bytes_out} / {hook.bytes_in}",
        ],
        [
            "one intercepted item (on_reply, default INTERCEPT, lock-step)",
            "0",
            f"{item.writes}",
            f"{item.reads}",
            f"{item.bytes_out} / {item.bytes_in}",
        ],
        [
            "one intercepted item, the middleware declaring run_ahead",
            "0",
            f"{p.item_ahead.writes}",
            f"{p.item_ahead.reads}",
            f"{p.item_ahead.bytes_out} / {p.item_ahead.bytes_in}",
        ],
        [
            f"ReplyEndOnly on_reply, 0-delta / {BYPASS_N:,}-delta reply",
            "1 / 1",
            f"{u.messages_per_reply[0]} / {u.messages_per_reply[BYPASS_N]} (both directions)",
            "",
            "",
        ],
        [
            "full reply with Realistic (3 tool rounds, 1,000 deltas)",
            _hooks(t.streams),
            f"{t.messages} (both directions)",
            "",
            "",
        ],
    ]


def _server_side(r: Results) -> str:
    p, u, t = r.protocol, r.unimplemented, r.traffic
    assert p is not None and u is not None and t is not None
    return (
        f"Counted inside the middleware processes: one on_check_permission pass-through ran "
        f"{_hooks(p.server_calls)}; during a full reply ReplyEndOnly ran {_hooks(u.server_calls)} "
        f"and its code saw {_hooks(u.server_items)} item(s); Realistic ran {_hooks(t.server_calls)} and its code "
        f"saw {_hooks(t.server_items)} item(s)."
    )


def _hooks(counts: dict[str, int]) -> str:
    return ", ".join(f"{hook} x{n}" for hook, n in sorted(counts.items()) if n) or "nothing"


METHOD = [
    "- 1a: a new bidirectional stream on an already-connected channel to a trivial echo servicer (raw bytes, "
    "no protobuf), one message of the protocol's mean host-message size each way, half-close, wait for the "
    "status. 1b: one write and one read on an open stream, item-delivery-sized messages. 1c: two exchanges "
    "on one new stream: the least a value-hook pass-through needs (Begin → CallNext, InnerDone → Finish).",
    "- 2: `Chain('on_check_permission', [RemoteMiddleware], core)` with a core that allows; the middleware "
    "process runs `return await next_handler()`.",
    f"- 3: an on_reply chain whose core replays {ITEMS} text deltas, with and without a middleware that "
    "intercepts every item; the difference divided by the item count (the invocation's fixed cost is "
    "included, so this is slightly pessimistic). The spun floor is the protobuf peer busy "
    f"{SPIN * 1e6:g} µs more per item on each side (bench/echo_server.py RunAheadSpun): on this machine a "
    "few microseconds of work per item on each side cost several times that end to end (likely: an answer "
    "that comes a little later finds the other process asleep, and waking it is slow), so it calibrates the "
    "per-item targets against agentmw's own per-item work, measured without I/O (bench/python_cost.py: "
    "HookCall and HookSession over stubs that answer at once, against the peer's loops over the same). "
    "Where the time goes: the real host with the peer attached as its middleware (bench/echo_server.py "
    "`--on-reply lockstep|run_ahead`), and the peer's host loop against the real SDK serving InterceptAll / "
    "InterceptAllRunAhead, each over the peer on both sides.",
    f"- 4: on_reply chains over {BYPASS_N:,} and 0 deltas with 1 and 4 ReplyEndOnly layers and with none; "
    f"per item per layer = ((mw {BYPASS_N:,} - mw 0) - (none {BYPASS_N:,} - none 0)) / ({BYPASS_N:,} x layers), "
    "host process CPU. Unimplemented hooks: `agent.compress_context()` plus the permission chain with an "
    "on_reply-only middleware attached, vs none attached.",
    "- 5: `Agent.reply_stream` with a scripted OfflineRuleModel; CPU is `time.process_time()` of the host "
    "process (event loop and gRPC threads). Realistic subscribes on_reply (intercept ReplyEndEvent, observe "
    "ReplyStartEvent), on_reasoning (observe ModelCallStart/End), on_model_call (observe the final "
    "response), on_acting (observe ToolResponse); everything else bypasses.",
    f"- 6: {CONCURRENT} `reply_stream`s started together with `asyncio.gather`; times from the common start.",
    "- Fix prototype rows: a bench-only subclass of OfflineRuleModel whose chunk stream does "
    "`await asyncio.sleep(0)` every 16 chunks, standing in for a yield in the host's streaming loop.",
    "- Built-in servers (bench/builtins.py): each of mw_servers.tracing, tts (standard and realtime) and mem0 "
    "runs as its own process (mem0 with the Python of .venv-mem0) and is attached to a fresh `Agent` per "
    "reply; its variants are interleaved with a no-middleware baseline of the same reply. Tracing: the "
    "whole-reply scenario of 5, the server exporting over OTLP/gRPC to a receiver in another process (the "
    "host does not trace); for context, the same TracingMiddleware in-process in a host process of its own "
    "(a bench.four_servers worker: the tracer provider is global), exporting to the same receiver, its "
    "replies interleaved with the others; and, for the budget of the target, the least any middleware on "
    "the same three hooks costs in-process (bench/middlewares.py WatcherFloor: a generator per streamed "
    "item and nothing else; the host's flat detached path wraps the same hooks the same way). "
    "TTS: one text block; the first audio is timed from the block's "
    "end (standard) or from the first text (realtime). mem0: a question after a few seeded facts; the reply end "
    "includes the awaited write-back.",
    *four_servers.METHOD,
    "- The AgentScope peer (optional) runs the same scripted replies in AgentScope 2.0.11 in its own "
    "virtual environment and process, driven over a pipe so that its runs take their turn in the same "
    "interleaved rounds.",
]
