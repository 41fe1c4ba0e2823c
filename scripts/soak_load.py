#!/usr/bin/env python3
"""Fixed-rate (open-loop) load of unique chat prompts over HTTP/1.1 keep-alive, for soak runs.

Send times are planned ahead (start + i / rate) and never wait for replies: a request whose
time has come takes an idle connection from the pool, or opens a new one up to --max-conns,
or waits for one (counted as "late" when it goes out more than 100 ms after its time).
Each request is a `/v1/chat/completions` body with a prompt no other request has (a counter
plus random words); every other one asks for `stream: true`, so both the length-delimited and
the chunked (SSE) relay paths run. Python 3 standard library only; loopback only.

Prints one JSON object on stdout at the end: requests sent, replies by status, errors by
kind, latency percentiles, lateness. Exits 0 only when every request got a 200.

Usage: soak_load.py --port PORT [--host 127.0.0.1] [--rate 50] [--secs 600]
"""

import argparse
import asyncio
import collections
import ipaddress
import json
import random
import sys
import time

WORDS = (
    "cache block prefix router engine token decode prefill batch river mountain violet "
    "copper lantern harbor quiet sudden narrow golden winter orchard signal vector kernel "
    "socket buffer branch window cobalt meadow pepper falcon marble thunder ember glacier "
    "saddle timber crystal ribbon anchor velvet canyon beacon harvest nimbus quartz tundra"
).split()

LATE_S = 0.1


class Conn:
    """One keep-alive connection: an asyncio reader/writer pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """Status code and lower-cased headers of one response head."""
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"bad status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> int:
    """Reads a Content-Length or chunked body; returns its length in bytes."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        total = 0
        for _ in range(1_000_000):  # bounded: a reply has far fewer chunks
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return total
            await reader.readexactly(size + 2)
            total += size
        raise ValueError("too many chunks")
    n = int(headers.get("content-length", "0"))
    await reader.readexactly(n)
    return n


class Load:
    """The run: pool, schedule, counters."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.idle: list[Conn] = []
        self.open_conns = 0
        self.peak_conns = 0
        self.conn_freed = asyncio.Condition()
        self.status: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.latencies: list[float] = []
        self.sent = 0
        self.late = 0
        self.max_late = 0.0
        self.stale_retries = 0
        self.rng = random.Random(args.seed)

    def body(self, i: int) -> bytes:
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(20, 60)))
        return json.dumps(
            {
                "model": self.args.model,
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"request {i} {self.rng.getrandbits(64):x}: {words}"},
                ],
                "max_tokens": self.args.max_tokens,
                "stream": i % 2 == 1,
            }
        ).encode()

    async def acquire(self) -> Conn:
        async with self.conn_freed:
            while not self.idle and self.open_conns >= self.args.max_conns:
                await self.conn_freed.wait()
            if self.idle:
                return self.idle.pop()
            self.open_conns += 1
            self.peak_conns = max(self.peak_conns, self.open_conns)
        try:
            r, w = await asyncio.open_connection(self.args.host, self.args.port)
        except BaseException:
            await self.release(None)
            raise
        return Conn(r, w)

    async def release(self, conn: "Conn | None") -> None:
        async with self.conn_freed:
            if conn is None:
                self.open_conns -= 1
            else:
                self.idle.append(conn)
            self.conn_freed.notify()

    async def one(self, i: int, due: float) -> None:
        body = self.body(i)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.args.host}:{self.args.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        conn = None
        try:
            conn = await asyncio.wait_for(self.acquire(), self.args.timeout)
            late = time.monotonic() - due
            self.max_late = max(self.max_late, late)
            if late > LATE_S:
                self.late += 1
            t0 = time.monotonic()
            try:
                conn.writer.write(head + body)
                await conn.writer.drain()
                status, headers = await asyncio.wait_for(read_head(conn.reader), self.args.timeout)
            except (OSError, asyncio.IncompleteReadError):
                # A pooled connection the router closed while idle (its keep-alive timeout):
                # nothing of the response came, so retry once on a new connection, as HTTP
                # clients do (and as kvroute does towards workers, bug-cases.md B42).
                conn.close()
                await self.release(None)
                conn = None
                self.stale_retries += 1
                conn = await asyncio.wait_for(self.acquire(), self.args.timeout)
                conn.writer.write(head + body)
                await conn.writer.drain()
                status, headers = await asyncio.wait_for(read_head(conn.reader), self.args.timeout)
            await asyncio.wait_for(read_body(conn.reader, headers), self.args.timeout)
            self.latencies.append(time.monotonic() - t0)
            self.status[status] += 1
            if headers.get("connection", "").lower() == "close":
                conn.close()
                conn = None
                await self.release(None)
            else:
                await self.release(conn)
                conn = None
        except (asyncio.TimeoutError, OSError, ValueError, asyncio.IncompleteReadError) as e:
            self.errors[type(e).__name__] += 1
            if conn is not None:
                conn.close()
                await self.release(None)

    async def run(self) -> dict:
        n = int(self.args.rate * self.args.secs)
        start = time.monotonic() + 0.2
        tasks = set()
        for i in range(n):
            due = start + i / self.args.rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= self.args.max_pending:
                self.errors["overload_skipped"] += 1
                continue
            t = asyncio.create_task(self.one(i, due))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            self.sent += 1
        if tasks:
            await asyncio.wait(tasks, timeout=self.args.timeout * 3)
        for c in self.idle:
            c.close()
        lat = sorted(self.latencies)

        def pct(p: float) -> "float | None":
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 2) if lat else None

        return {
            "requests_planned": n,
            "requests_sent": self.sent,
            "replies": sum(self.status.values()),
            "status": {str(k): v for k, v in sorted(self.status.items())},
            "errors": dict(self.errors),
            "unfinished": sum(1 for t in tasks if not t.done()),
            "latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
            "late_sends": self.late,
            "max_lateness_ms": round(self.max_late * 1000, 2),
            "connections_peak": self.peak_conns,
            "stale_connection_retries": self.stale_retries,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rate", type=float, default=50.0, help="requests per second")
    ap.add_argument("--secs", type=float, default=600.0, help="length of the schedule")
    ap.add_argument("--model", default="qwen3-sim")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-conns", type=int, default=64, help="keep-alive pool size")
    ap.add_argument("--max-pending", type=int, default=2000, help="in-flight cap (then skip)")
    ap.add_argument("--timeout", type=float, default=30.0, help="per request phase, s")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if not ipaddress.ip_address(args.host).is_loopback:
        print("soak_load.py: refusing a non-loopback host", file=sys.stderr)
        return 2
    if args.rate <= 0 or args.secs <= 0:
        print("soak_load.py: --rate and --secs must be positive", file=sys.stderr)
        return 2
    summary = asyncio.run(Load(args).run())
    print(json.dumps(summary))
    ok = (
        summary["requests_sent"] == summary["requests_planned"]
        and summary["status"] == {"200": summary["requests_sent"]}
        and not summary["errors"]
        and summary["unfinished"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
