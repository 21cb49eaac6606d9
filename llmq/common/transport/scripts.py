"""The Lua scripts of a request's output: its record, its publication, its owner. They take
every key name from their caller (``keys.Keys``); ``output_log`` describes the record."""

from __future__ import annotations

from llmq.common.transport.keys import GROUP
from llmq.common.transport.output_log import CLAIM_MARK

# Ownership fencing. A request's hash names its owner (field ``worker``) and its live stream
# entry (field ``entry``); a claim moves both at once, so every write a worker makes for a
# request first checks that it still owns it: a worker that froze past its heartbeat and woke
# after another took its requests over publishes nothing more for them (and does not XACK the
# entry the new owner now holds). A request re-enqueued (a batch line run again) has a new
# entry: writes for the old one are refused too. No owner or entry recorded: no fence. (A
# step's writes are fenced once for all its requests: STEP_SCRIPT.)
_FENCE = f"""
local own = redis.call('HMGET', KEYS[1], 'worker', 'entry')
if own[2] and own[2] ~= ARGV[2] then
  redis.call('XACK', KEYS[5], '{GROUP}', ARGV[2])
  redis.call('XDEL', KEYS[5], ARGV[2])
  return 'fenced:' .. (own[1] or '')
end
if own[1] and own[1] ~= ARGV[1] then return 'fenced:' .. own[1] end
"""

# One request's news written alone (a worker's first writes, and every write after its log
# changed under it: a claim, or Redis lost its tail). KEYS: req, tokens, logprobs, channel,
# stream. ARGV: worker, entry, index, token count n, payload (published unless flag 'q'),
# flags ('l': logprob entries follow the tokens, 'p': the prompt logprobs follow, 'f': final,
# 'q': record only), the n tokens, [n logprob entries], [prompt logprobs], [final state,
# finish_reason, error, finished time, record TTL]. Tokens are appended idempotently (a write
# sent again records nothing twice); a record shorter than ``index`` lost its tail (Redis
# restarted without it): nothing is appended out of place, and 'lost:<length>' says so.
WRITE_SCRIPT = (
    _FENCE
    + f"""
local first, n, flags = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[6]
local at = 6 + n
local have = redis.call('LLEN', KEYS[2])
if have < first then return 'lost:' .. have end
for i = have - first + 1, n do redis.call('RPUSH', KEYS[2], ARGV[6 + i]) end
if string.find(flags, 'l', 1, true) then
  local lps = redis.call('LLEN', KEYS[3])
  if lps < first then return 'lost:' .. lps end
  for i = lps - first + 1, n do redis.call('RPUSH', KEYS[3], ARGV[at + i]) end
  at = at + n
end
if string.find(flags, 'p', 1, true) then
  redis.call('HSET', KEYS[1], 'prompt_logprobs', ARGV[at + 1])
  at = at + 1
end
if not string.find(flags, 'q', 1, true) then redis.call('PUBLISH', KEYS[4], ARGV[5]) end
if string.find(flags, 'f', 1, true) then
  redis.call('HSET', KEYS[1], 'state', ARGV[at + 1], 'finish_reason', ARGV[at + 2],
    'finished', ARGV[at + 4])
  if ARGV[at + 3] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[at + 3]) end
  for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[at + 5]) end
  redis.call('XACK', KEYS[5], '{GROUP}', ARGV[2])
  redis.call('XDEL', KEYS[5], ARGV[2])
end
return 0
"""
)

# One step of a worker, every request's news in one call, a few commands whatever the batch.
# KEYS: the worker's log, its stream, then req, tokens, logprobs of each op. ARGV: the log's
# last entry as the worker left it, worker, now, record TTL, '1' to move (trim the log to its
# last entry), then the count and the (request id, log value) pairs to log, the count and the
# (channel, payload) pairs to publish, then the ops: flags ('a' append, 'l' logprobs, 'p'
# prompt logprobs follow, 'f' final: state, finish_reason, error follow), entry, first index,
# token count n, logprob count, the tokens, the logprob entries, [prompt], [final].
# A log whose last entry is not the worker's (a claimer marked it, or Redis lost its tail)
# writes nothing: {'check', last entry}; else {last entry, op number, refusal, ...}.
STEP_SCRIPT = f"""
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local lid = ''
if last[1] then lid = last[1][1] end
if lid ~= ARGV[1] then return {{'check', lid}} end
local np, at = tonumber(ARGV[6]), 7
if np > 0 then
  local fields = {{}}
  for i = 1, 2 * np do fields[i] = ARGV[at + i - 1] end
  lid = redis.call('XADD', KEYS[1], '*', unpack(fields))
  at = at + 2 * np
end
local nc = tonumber(ARGV[at])
local channels = at + 1
at = channels + 2 * nc
local result, op = {{lid}}, 0
while at <= #ARGV do
  local req, tk, lk = KEYS[3 + 3 * op], KEYS[4 + 3 * op], KEYS[5 + 3 * op]
  op = op + 1
  local flags, entry, first = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2])
  local n, nl, t0 = tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4]), at + 5
  at = t0 + n + nl
  local why
  if string.find(flags, 'f', 1, true) then
    local own = redis.call('HMGET', req, 'worker', 'entry')
    if own[2] and own[2] ~= entry then
      redis.call('XACK', KEYS[2], '{GROUP}', entry)
      redis.call('XDEL', KEYS[2], entry)
      why = 'fenced:' .. (own[1] or '')
    elseif own[1] and own[1] ~= ARGV[2] then why = 'fenced:' .. own[1] end
  end
  if not why then
    local have = redis.call('LLEN', tk)
    if have < first then why = 'lost:' .. have end
    if not why then
      for i = have - first + 1, n do redis.call('RPUSH', tk, ARGV[t0 + i - 1]) end
    end
    if not why and nl > 0 then
      local lps = redis.call('LLEN', lk)
      if lps < first then why = 'lost:' .. lps end
      if not why then
        for i = lps - first + 1, nl do redis.call('RPUSH', lk, ARGV[t0 + n + i - 1]) end
      end
    end
  end
  if string.find(flags, 'p', 1, true) then
    if not why then redis.call('HSET', req, 'prompt_logprobs', ARGV[at]) end
    at = at + 1
  end
  if string.find(flags, 'f', 1, true) then
    if not why then
      redis.call('HSET', req, 'state', ARGV[at], 'finish_reason', ARGV[at + 1],
        'finished', ARGV[3], 'error', ARGV[at + 2])
      redis.call('EXPIRE', req, ARGV[4])
      redis.call('EXPIRE', tk, ARGV[4])
      if string.find(flags, 'l', 1, true) then redis.call('EXPIRE', lk, ARGV[4]) end
      redis.call('XACK', KEYS[2], '{GROUP}', entry)
      redis.call('XDEL', KEYS[2], entry)
    end
    at = at + 3
  end
  if why then
    result[#result + 1] = op
    result[#result + 1] = why
  end
end
for c = 0, nc - 1 do
  redis.call('PUBLISH', ARGV[channels + 2 * c], ARGV[channels + 2 * c + 1])
end
if ARGV[5] == '1' then
  redis.call('XTRIM', KEYS[1], 'MAXLEN', 1)
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
return result
"""

# Lua: move into a request's list (tk, lk: its tokens and logprobs) what the log ``log`` holds
# of it past the list's end, in log order (a value past a hole ends it). Returns the length.
_ABSORB = """
local function absorb(log, rid, tk, lk)
  local have, lps = redis.call('LLEN', tk), redis.call('LLEN', lk)
  for _, e in ipairs(redis.call('XRANGE', log, '-', '+')) do
    local f = e[2]
    for i = 1, #f - 1, 2 do
      if f[i] == rid then
        local v = f[i + 1]
        local a = string.find(v, '|', 1, true)
        local b = string.find(v, '|', a + 1, true)
        local first = tonumber(string.sub(v, 1, a - 1))
        if first > have then return have end
        local j = first
        for t in string.gmatch(string.sub(v, a + 1, (b or 0) - 1), '[^,]+') do
          if j == have then
            redis.call('RPUSH', tk, t)
            have = have + 1
          end
          j = j + 1
        end
        if b then
          j = first
          for l in string.gmatch(string.sub(v, b + 1), '[^\\n]+') do
            if j == lps then
              redis.call('RPUSH', lk, l)
              lps = lps + 1
            end
            j = j + 1
          end
        end
      end
    end
  end
  return have
end
"""

# A request taken into service (pulled, claimed or resumed): owned by this worker unless
# another took it over meanwhile. KEYS: req, -, -, -, stream. ARGV: worker, entry, now.
RUNNING_SCRIPT = (
    _FENCE
    + """
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[1], 'entry', ARGV[2],
  'started', ARGV[3])
return 0
"""
)

# Take over one entry of a dead worker, with its request: XCLAIM (only if still idle for
# ARGV[3] ms, so a second claimer loses the race), the old owner's log tail moved into the
# request's list and the log marked (the old owner, if it wakes, finds its log changed), the
# new owner in the hash, and the tokens recorded, atomically, so the claimer resumes from
# exactly what the old owner's clients saw. KEYS: stream, req, tokens, logprobs. ARGV: group,
# worker, min idle, entry, log key prefix, request id, log TTL. Returns false (not claimed),
# 'stale' (an entry its request no longer runs under: dropped), or {fields, state, tokens}.
CLAIM_SCRIPT = (
    _ABSORB
    + f"""
local got = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
if #got == 0 or not got[1] or not got[1][2] then
  if #got > 0 then redis.call('XACK', KEYS[1], ARGV[1], ARGV[4]) end
  return false
end
local own = redis.call('HMGET', KEYS[2], 'entry', 'worker', 'state')
if own[1] and own[1] ~= ARGV[4] then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[4])
  redis.call('XDEL', KEYS[1], ARGV[4])
  return 'stale'
end
if own[2] and own[2] ~= ARGV[2] then
  local log = ARGV[5] .. own[2]
  absorb(log, ARGV[6], KEYS[3], KEYS[4])
  redis.call('XADD', log, '*', '{CLAIM_MARK}', ARGV[6])
  redis.call('EXPIRE', log, ARGV[7])
end
redis.call('HSET', KEYS[2], 'worker', ARGV[2])
return {{got[1][2], own[3] or '', redis.call('LRANGE', KEYS[3], 0, -1)}}
"""
)

# A worker restarted under its name takes its own requests back: their tails in its log move
# into their lists first. KEYS: req, tokens, logprobs. ARGV: log key, request id. Returns
# {state, tokens}.
TAKE_SCRIPT = (
    _ABSORB
    + """
absorb(ARGV[1], ARGV[2], KEYS[2], KEYS[3])
return {redis.call('HGET', KEYS[1], 'state') or '', redis.call('LRANGE', KEYS[2], 0, -1)}
"""
)

# A reader's view of a request, in one atomic read: its hash, its list of tokens (and
# logprobs, with ARGV[3] = '1'), and the values its owner's log holds for it. KEYS: req,
# tokens, logprobs. ARGV: log key prefix, request id, '1' for logprobs.
READ_SCRIPT = """
local h = redis.call('HGETALL', KEYS[1])
local worker
for i = 1, #h - 1, 2 do
  if h[i] == 'worker' then worker = h[i + 1] end
end
local lps = {}
if ARGV[3] == '1' then lps = redis.call('LRANGE', KEYS[3], 0, -1) end
local values = {}
if worker then
  for _, e in ipairs(redis.call('XRANGE', ARGV[1] .. worker, '-', '+')) do
    local f = e[2]
    for i = 1, #f - 1, 2 do
      if f[i] == ARGV[2] then values[#values + 1] = f[i + 1] end
    end
  end
end
return {h, redis.call('LRANGE', KEYS[2], 0, -1), lps, values}
"""
