#!/usr/bin/env python3
"""Issue 13's newcomer trial, redone on loopback: two simulated engines behind `kvroute serve`
(release binary), each step as a user would do it, printing what they would see.

Usage: python3 scripts/trial.py [KVROUTE_BIN]   (default target/release/kvroute)
Needs: the openai package (`pip install openai`) for the SDK step; everything else is stdlib.
Every wait is bounded; all processes are killed at the end.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/kvroute"
procs = []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def start(args, log):
    p = subprocess.Popen([BIN] + args, stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    return p


def wait_port(port, secs=20):
    until = time.time() + secs
    while time.time() < until:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"port {port} never opened")


def http(method, url, body=None, headers=None, timeout=30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
    except Exception as e:  # connection refused, timeout
        return None, {}, str(e).encode()


def engine(port, model, log):
    return start(["engine", "--listen", f"127.0.0.1:{port}", "--model", model, "--speedup-ratio", "4"], log)


def main():
    logdir = tempfile.mkdtemp(prefix="kvroute-trial-")
    elog = open(os.path.join(logdir, "engines.log"), "w")
    rlog_path = os.path.join(logdir, "router.log")
    rlog = open(rlog_path, "w")
    e1, e2, rp, ap = free_port(), free_port(), free_port(), free_port()
    engines = {e1: engine(e1, "qwen3-sim", elog), e2: engine(e2, "qwen3-sim", elog)}
    wait_port(e1)
    wait_port(e2)
    cfg = os.path.join(logdir, "kvroute.toml")
    with open(cfg, "w") as f:
        f.write(f'workers = ["http://127.0.0.1:{e1}", "http://127.0.0.1:{e2}"]\n')
    router = start(["serve", "--config", cfg, "--listen", f"127.0.0.1:{rp}", "--admin-listen",
                    f"127.0.0.1:{ap}", "--health-check-interval-secs", "2",
                    "--health-check-timeout-secs", "1", "--api-key", "sk-trial"], rlog)
    wait_port(rp)
    base, admin = f"http://127.0.0.1:{rp}", f"http://127.0.0.1:{ap}"
    auth = {"authorization": "Bearer sk-trial"}
    chat = lambda text, n=8, stream=False: {"model": "qwen3-sim", "max_tokens": n, "stream": stream,
                                            "messages": [{"role": "user", "content": text}]}
    print(f"logs in {logdir}")

    # 1. One engine killed.
    engines[e2].kill()
    engines[e2].wait()
    codes = [http("POST", base + "/v1/chat/completions", chat(f"same prompt {i % 2}"), auth)[0] for i in range(20)]
    print(f"1. engine killed: 20 requests -> {codes.count(200)} x 200, others {[c for c in codes if c != 200]}")
    import openai
    client = openai.OpenAI(base_url=base + "/v1", api_key="sk-trial")
    ok = 0
    for i in range(20):
        try:
            client.chat.completions.create(model="qwen3-sim", messages=[{"role": "user", "content": f"sdk {i}"}], max_tokens=4)
            ok += 1
        except Exception as e:
            print("   sdk error:", e)
    print(f"   OpenAI SDK: {ok}/20 succeeded")
    time.sleep(5)
    st = http("GET", base + "/readiness")[0], http("GET", base + "/health")[0]
    workers = json.loads(http("GET", admin + "/workers")[2])
    print(f"   /readiness {st[0]}, /health {st[1]}; worker states {[w['state'] for w in workers]}")

    # 2. Restart it; one engine stopped (SIGSTOP) instead.
    engines[e2] = engine(e2, "qwen3-sim", elog)
    wait_port(e2)
    until = time.time() + 15
    while time.time() < until and any(w["state"] != "healthy" for w in json.loads(http("GET", admin + "/workers")[2])):
        time.sleep(0.5)
    print(f"2. restarted: states {[w['state'] for w in json.loads(http('GET', admin + '/workers')[2])]}")
    engines[e1].send_signal(signal.SIGSTOP)
    t0 = time.time()
    codes = [http("POST", base + "/v1/chat/completions", chat(f"stopped {i}"), auth, timeout=200)[0] for i in range(6)]
    print(f"   engine SIGSTOPped: 6 requests -> {codes} in {time.time() - t0:.1f} s")
    engines[e1].send_signal(signal.SIGCONT)

    # 3. Models.
    s, _, b = http("POST", base + "/v1/chat/completions", {"model": "other-model", "messages": [{"role": "user", "content": "x"}]}, auth)
    print(f"3. model other-model -> {s} {b[:90]!r}")
    s, _, b = http("POST", base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, auth)
    print(f"   no model -> {s}")
    s, _, b = http("GET", base + "/v1/models", headers=auth)
    print(f"   /v1/models -> {s} {[m['id'] for m in json.loads(b)['data']]}")
    print(f"   models.retrieve -> {client.models.retrieve('qwen3-sim').id}")

    # 4. Fleet changes at run time.
    e3 = free_port()
    engines[e3] = engine(e3, "qwen3-sim", elog)
    wait_port(e3)
    s, _, b = http("POST", admin + "/workers", {"url": f"http://127.0.0.1:{e3}"})
    new_id = json.loads(b)["id"]
    s2 = http("POST", admin + f"/workers/{new_id}/drain")[0]
    s3 = http("DELETE", admin + f"/workers/{new_id}")[0]
    print(f"4. admin: add -> {s} id {new_id}, drain -> {s2}, remove -> {s3}; workers now {[w['id'] for w in json.loads(http('GET', admin + '/workers')[2])]}")

    # 5. Security and headers.
    print(f"5. no key -> {http('POST', base + '/v1/chat/completions', chat('x'))[0]}, wrong key -> "
          f"{http('POST', base + '/v1/chat/completions', chat('x'), {'authorization': 'Bearer nope'})[0]}")
    second = subprocess.run([BIN, "serve", "--listen", f"127.0.0.1:{rp}", "--admin-listen", "", "--worker", f"http://127.0.0.1:{e1}"],
                            capture_output=True, text=True, timeout=30)
    said = next((l for l in second.stderr.splitlines() if l.startswith("Error")), second.stderr[-200:])
    print(f"   second serve on the same port: exit {second.returncode}: {said[:140]}")
    s, h, _ = http("POST", base + "/v1/chat/completions", chat("x"), {**auth, "connection": "keep-alive, x-secret", "x-secret": "1"})
    print(f"   x-kvroute-worker: {h.get('x-kvroute-worker')!r}, x-request-id present: {'x-request-id' in {k.lower() for k in h}}")
    metrics = http("GET", base + "/metrics")[2].decode()
    path = os.path.join(logdir, "metrics.txt")
    open(path, "w").write(metrics)
    pc = subprocess.run(["promtool", "check", "metrics"], stdin=open(path), capture_output=True, text=True)
    print(f"   promtool check metrics: exit {pc.returncode} {pc.stdout.strip()[:100]}{pc.stderr.strip()[:200]}")

    # 6. SIGTERM with a 2,000-token stream in flight.
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(chat("long", 2000, True)).encode(),
                                 headers={**auth, "content-type": "application/json"})
    r = urllib.request.urlopen(req, timeout=120)
    first = r.read1(256)
    router.send_signal(signal.SIGTERM)
    rest = first + r.read()
    tokens = rest.count(b'"content":') - 1
    code = router.wait(timeout=60)
    rlog.flush()
    log = open(rlog_path).read()
    print(f"6. SIGTERM mid-stream: {tokens} content events, [DONE] {b'[DONE]' in rest}, router exit {code}")
    said = [l.split("kvroute_io::shard: ")[-1][:70] for l in log.splitlines() if "shutting down" in l or "shutdown complete" in l]
    print("   log lines:", said)
    print(f"   ANSI escapes in the log file: {chr(27) in log}; access-log lines: {log.count('kvroute::access')}")


try:
    main()
finally:
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except Exception:
            pass
