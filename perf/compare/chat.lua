-- wrk script of perf/compare.sh: POST ~1 KB OpenAI chat bodies, a shared 800-character
-- system prompt and one of 1,000 user questions picked at random per request (seeded per
-- thread, so runs repeat), to /v1/chat/completions.
local system = string.rep("You are a careful assistant for a fleet operator. ", 16):sub(1, 800)
local topics = { "prefill", "decode", "KV cache", "eviction", "batching", "TTFT", "TPOT",
  "tensor parallelism", "paged attention", "speculative decoding" }
local bodies = {}
function init(args)
  math.randomseed(id or 1)
  for i = 1, 1000 do
    local q = string.format("Question %d: how does %s interact with %s when the fleet has %d workers?",
      i, topics[(i % #topics) + 1], topics[((i * 7) % #topics) + 1], 2 + (i % 64))
    bodies[i] = string.format(
      '{"model":"m","max_tokens":16,"messages":[{"role":"system","content":"%s"},{"role":"user","content":"%s"}]}',
      system, q)
  end
end
function setup(thread) thread:set("id", math.random(1, 1000000)) end
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
function request()
  return wrk.format(nil, "/v1/chat/completions", nil, bodies[math.random(1, #bodies)])
end
