import http.client, sys, random
port, n = int(sys.argv[1]), int(sys.argv[2])
system = ("You are a careful assistant for a fleet operator. " * 16)[:800]
topics = ["prefill","decode","KV cache","eviction","batching","TTFT","TPOT","tensor parallelism","paged attention","speculative decoding"]
bodies = []
for i in range(1, 1001):
    q = "Question %d: how does %s interact with %s when the fleet has %d workers?" % (i, topics[i % 10], topics[(i*7) % 10], 2 + i % 64)
    bodies.append('{"model":"m","max_tokens":16,"messages":[{"role":"system","content":"%s"},{"role":"user","content":"%s"}]}' % (system, q))
random.seed(1)
c = http.client.HTTPConnection("127.0.0.1", port)
for k in range(n):
    c.request("POST", "/v1/chat/completions", body=bodies[random.randrange(1000)], headers={"content-type": "application/json"})
    r = c.getresponse(); r.read()
    assert r.status == 200, r.status
