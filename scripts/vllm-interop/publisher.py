#!/usr/bin/env python3
"""Publishes KV events with vLLM's own publisher, for io/tests/vllm_interop.rs.

Loads `vllm/distributed/kv_events.py` extracted from the vLLM wheel (scripts/vllm-interop/
fetch.sh) without installing vLLM: its few `from vllm... import` lines are satisfied by stub
modules built from the file's own import list (known names get small working stand-ins;
anything else raises when used). Everything on the wire (msgspec structs, EventBatch,
ZmqEventPublisher's PUB, seq counter, replay ROUTER and end marker, DP-rank port offsets) is
vLLM's code.

Protocol (one JSON object per stdout line; the test drives it over stdin):
  1. Starts the publishers, publishes phase A (before the router subscribes), prints
     {"ready": {"workers": [{"events": EP, "replay": EP, "dp": N}, ...], "wheel": ...}}.
  2. Waits for a stdin line "go", publishes phase B live, prints
     {"done": {"streams": [{"worker", "rank", "cached": [prefix...], "removed": [prefix...],
     "hashes": [u64...]}], "batches": N}}
     where each prefix is the full token list from the root through that block.
  3. Waits for "exit" (or EOF), shuts the publishers down.

Scenario (deterministic, seed 5): worker 0 has one rank, int hashes (vLLM default); worker 1
has two DP ranks (ports base and base+1) and 32-byte bytes hashes (vLLM with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0). Each stream gets roots, child stores, leaf removals
and one AllBlocksCleared in phase A (so a replay from 0 must apply it), then more stores
(children of phase-A blocks: orphans unless the replay taught the router their parents),
removals and, on worker 1 rank 1, a second clear.
"""

import argparse
import ast
import dataclasses
import hashlib
import json
import logging
import random
import socket
import sys
import time
import types

BLOCK = 16


def load_kv_events(path):
    """Executes kv_events.py as module `vllm.distributed.kv_events` with stubbed vLLM imports."""
    src = open(path, encoding="utf-8").read()
    tree = ast.parse(src)

    @dataclasses.dataclass
    class KVEventsConfig:  # vllm.config.kv_events.KVEventsConfig (fields used by the file)
        enable_kv_cache_events: bool = False
        publisher: str = "null"
        endpoint: str = "tcp://*:5557"
        replay_endpoint: str | None = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    def split_zmq_path(path):
        scheme, rest = path.split("://", 1)
        host, _, port = rest.rpartition(":")
        return scheme, host.strip("[]"), port

    known = {
        "KVEventsConfig": KVEventsConfig,
        "init_logger": logging.getLogger,
        "get_ip": lambda: "127.0.0.1",
        "get_tcp_uri": lambda ip, port: f"tcp://{ip}:{port}",
        "is_valid_ipv6_address": lambda a: ":" in a,
        "split_zmq_path": split_zmq_path,
        "ExternalBlockHash": bytes | int,
    }

    class Missing:
        def __init__(self, name):
            self.name = name

        def __call__(self, *a, **k):
            raise RuntimeError(f"vLLM stub {self.name} used; add it to publisher.py")

    stubbed = []
    for node in ast.walk(tree):
        mods = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
            mods = [(node.module, [a.name for a in node.names])]
        elif isinstance(node, ast.Import):
            mods = [(a.name, []) for a in node.names if a.name.startswith("vllm")]
        for mod, names in mods:
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):
                sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
            m = sys.modules[mod]
            for n in names:
                setattr(m, n, known.get(n, Missing(f"{mod}.{n}")))
                stubbed.append(f"{mod}.{n}")
    mod = types.ModuleType("vllm.distributed.kv_events")
    mod.__file__ = path
    sys.modules["vllm.distributed.kv_events"] = mod
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod, stubbed


def free_base_port(width):
    """A loopback port p with p..p+width-1 free right now (bounded search)."""
    for _ in range(50):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        s.close()
        ok = True
        for q in range(p, p + width):
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", q))
            except OSError:
                ok = False
            finally:
                t.close()
        if ok and p + width < 65536:
            return p
    raise RuntimeError("no free port range")


class Stream:
    """One (worker, rank) publisher and a model of what its engine caches."""

    def __init__(self, kv, pub, worker, rank, bytes_hashes, rng):
        self.kv, self.pub, self.worker, self.rank = kv, pub, worker, rank
        self.bytes_hashes = bytes_hashes
        self.rng = rng
        self.cached = {}  # wire hash -> prefix tokens (tuple)
        self.children = {}  # wire hash -> count of cached children
        self.parent = {}  # wire hash -> parent wire hash or None
        self.removed = []  # prefixes removed and not re-stored
        self.batches = 0

    def wire_hash(self, prefix):
        d = hashlib.sha256(repr((self.worker, self.rank, prefix)).encode()).digest()
        return d if self.bytes_hashes else int.from_bytes(d[-8:], "big")

    def store_events(self, n):
        kv, rng = self.kv, self.rng
        events = []
        for _ in range(n):
            if self.cached and rng.random() < 0.6:
                parent = rng.choice(sorted(self.cached, key=repr))
                prefix = self.cached[parent]
            else:
                parent, prefix = None, ()
            k = rng.randint(1, 4)
            tokens = [rng.randrange(1, 150_000) for _ in range(k * BLOCK)]
            hashes, prev = [], parent
            for b in range(k):
                prefix = prefix + tuple(tokens[b * BLOCK:(b + 1) * BLOCK])
                h = self.wire_hash(prefix)
                hashes.append(h)
                self.cached[h] = prefix
                self.parent[h] = prev
                self.children.setdefault(h, 0)
                if prev is not None:
                    self.children[prev] = self.children.get(prev, 0) + 1
                prev = h
            events.append(kv.BlockStored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None))
        return events

    def remove_events(self, n):
        """Removes up to n leaves (as vLLM evicts: a cached block has its prefix cached)."""
        out = []
        for _ in range(n):
            leaves = sorted((h for h in self.cached if self.children.get(h, 0) == 0), key=repr)
            if not leaves:
                break
            h = self.rng.choice(leaves)
            self.removed.append(self.cached.pop(h))
            p = self.parent.pop(h)
            self.children.pop(h, None)
            if p is not None:
                self.children[p] -= 1
            out.append(self.kv.BlockRemoved(block_hashes=[h], medium="GPU"))
        return out

    def clear_events(self):
        self.removed.extend(self.cached.values())
        self.cached.clear()
        self.children.clear()
        self.parent.clear()
        return [self.kv.AllBlocksCleared()]

    def publish(self, events):
        self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=events))
        self.batches += 1

    def phase(self, steps, clear_at=None):
        for i in range(steps):
            if i == clear_at:
                self.publish(self.clear_events())
                continue
            ev = self.store_events(self.rng.randint(1, 3))
            if i % 3 == 2:
                ev += self.remove_events(self.rng.randint(1, 2))
            self.publish(ev)

    def report(self):
        live = set(self.cached.values())
        return {
            "worker": self.worker,
            "rank": self.rank,
            "cached": [list(p) for p in sorted(live)],
            "removed": [list(p) for p in sorted(set(self.removed) - live)],
            "hashes": sorted(int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h
                             for h in self.cached),
        }


def wait_drained(streams, deadline_s=10.0):
    end = time.time() + deadline_s
    for s in streams:
        while s.pub._event_queue.unfinished_tasks and time.time() < end:
            time.sleep(0.01)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-events", required=True, help="path of vllm/distributed/kv_events.py")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    kv, stubbed = load_kv_events(args.kv_events)
    rng = random.Random(args.seed)

    # vLLM binds a PUB only for wildcard/ipc endpoints and connects otherwise; the test stays
    # on loopback, so bind the literal 127.0.0.1 endpoint (the only behaviour changed).
    kv.ZmqEventPublisher._is_bind_endpoint = staticmethod(lambda ep: True)
    layout = [(0, 1, False), (1, 2, True)]  # (worker, dp ranks, bytes hashes)
    streams, workers = [], []
    for worker, dp, bytes_hashes in layout:
        ev_base, rp_base = free_base_port(dp), free_base_port(dp)
        for rank in range(dp):
            # vLLM offsets the ports by the rank itself (offset_endpoint_port).
            pub = kv.ZmqEventPublisher(
                data_parallel_rank=rank,
                endpoint=f"tcp://127.0.0.1:{ev_base}",
                replay_endpoint=f"tcp://127.0.0.1:{rp_base}",
            )
            streams.append(Stream(kv, pub, worker, rank, bytes_hashes, rng))
        workers.append({"events": f"tcp://127.0.0.1:{ev_base}",
                        "replay": f"tcp://127.0.0.1:{rp_base}", "dp": dp})

    for s in streams:  # phase A: before the router subscribes
        s.phase(30, clear_at=12)
    wait_drained(streams)
    wheel = open(args.kv_events.replace("vllm/distributed/kv_events.py", "WHEEL")).read().strip() \
        if args.kv_events.endswith("vllm/distributed/kv_events.py") else None
    print(json.dumps({"ready": {"workers": workers, "wheel": wheel, "stubbed": stubbed}}),
          flush=True)

    for _ in range(100):
        line = sys.stdin.readline()
        if not line or line.strip() == "go":
            break
    for s in streams:  # phase B: live
        s.phase(25, clear_at=20 if (s.worker, s.rank) == (1, 1) else None)
    wait_drained(streams)
    print(json.dumps({"done": {"streams": [s.report() for s in streams],
                               "batches": sum(s.batches for s in streams)}}), flush=True)
    for _ in range(100):
        line = sys.stdin.readline()
        if not line or line.strip() == "exit":
            break
    for s in streams:
        s.pub.shutdown()


if __name__ == "__main__":
    main()
