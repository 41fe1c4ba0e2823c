#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/.

Seeds are small hand-made inputs: vLLM-style request bodies, HTTP/1.1 heads (chunked ones
with a body after the head), routing-token header values, and the golden KV-event payloads
G1..G7, read from core/src/events/decode/tests.rs (kv-events.md section 4) so the bytes have
one home. Re-running rewrites the same files; libFuzzer adds its own finds beside them.

Usage: python3 fuzz/make_corpus.py
"""

import json
import pathlib
import re
import struct

FUZZ = pathlib.Path(__file__).resolve().parent
ROOT = FUZZ.parent
CORPUS = FUZZ / "corpus"


def write(target: str, name: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def chat(messages, **extra) -> bytes:
    return json.dumps({"model": "qwen3", "messages": messages, **extra}).encode()


def http_seeds() -> None:
    body = chat([{"role": "user", "content": "Hello!"}], stream=True, max_tokens=16)
    write(
        "http1_request",
        "chat_content_length",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
    )
    chunks = body[:20], body[20:]
    wire = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks)
    write(
        "http1_request",
        "chat_chunked",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Expect: 100-continue\r\n\r\n" + wire + b"0\r\nx-trailer: 1\r\n\r\n",
    )
    write(
        "http1_request",
        "chunked_pipelined",
        b"POST /generate HTTP/1.1\r\ntransfer-encoding: chunked\r\nconnection: keep-alive\r\n"
        b"x-kvroute-routing-tokens: 1,2,3\r\n\r\n5\r\nhello\r\n0\r\n\r\nGET /health HTTP/1.1\r\n\r\n",
    )
    write("http1_request", "get_http10", b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    write(
        "http1_request",
        "resp_sse_chunked",
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        b"1c\r\ndata: {\"choices\":[{\"x\":1}]}\n\n\r\n0\r\n\r\n",
    )
    write(
        "http1_request",
        "resp_length_close",
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
    )
    write("http1_request", "resp_204", b"HTTP/1.1 204 No Content\r\n\r\n")
    write("http1_request", "resp_until_close", b"HTTP/1.0 200 OK\r\nserver: x\r\n\r\nbody")


def kv_seeds() -> None:
    src = (ROOT / "core/src/events/decode/tests.rs").read_text()
    golden = dict(re.findall(r'const (G\d): &str = "([0-9a-f\s]+)";', src))
    assert len(golden) == 7, sorted(golden)
    for name, hexdump in sorted(golden.items()):
        write("kv_events", name, bytes.fromhex("".join(hexdump.split())))
    # The frame path: count 3, topic (length byte 0), seq (length byte 8), payload G2.
    g2 = bytes.fromhex("".join(golden["G2"].split()))
    write("kv_events", "live_frames_g2", bytes([3, 0, 8]) + struct.pack(">Q", 7) + g2)
    # Replay end marker: [seq = ff * 8, empty payload].
    write("kv_events", "replay_end", bytes([2, 8]) + b"\xff" * 8)


def token_seeds() -> None:
    for name, value in [
        ("three", "1,2,3"),
        ("spaces_max", " 7 , 4294967295"),
        ("chat_head", "151644,872,198,9707,151645,198,151644,77091,198"),
        ("bad_empty_item", "1,,2"),
        ("max_ids", ",".join(["1"] * 512)),
    ]:
        write("routing_tokens_header", name, value.encode())


def route_key_seeds() -> None:
    seeds = {
        "chat_simple": chat([{"role": "user", "content": "What is a KV cache?"}]),
        "chat_turns": chat(
            [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "hi \u00e9\U0001f600 \"q\""},
                {"role": "assistant", "content": "yo", "tool_calls": [{"id": "1"}]},
                {"role": "user", "content": "more"},
            ],
            stream=True,
            temperature=0.2,
            cache_salt="s1",
        ),
        "chat_parts": chat(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "compare"},
                        {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                        {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
                    ],
                }
            ],
            model="qwen3:lora-a",
        ),
        "completions_text": b'{"model":"m","prompt":"Once upon","max_tokens":8,"lora_id":7}',
        "completions_ids": b'{"prompt":[[4,5],[6]],"extra_key":"e"}',
        "generate_ids": b'{"input_ids":[1,2,3],"text":null,"image_data":["a",["b"]],"lora_path":"p"}',
        "generate_text": b'{"text":["x","y"],"sampling_params":{"max_new_tokens":1}}',
    }
    for name, body in seeds.items():
        write("route_key", name, body)


if __name__ == "__main__":
    http_seeds()
    kv_seeds()
    token_seeds()
    route_key_seeds()
    print("wrote", sum(1 for _ in CORPUS.rglob("*") if _.is_file()), "seed files under", CORPUS)
