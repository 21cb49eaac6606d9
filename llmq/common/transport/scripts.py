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

# Lua: RPUSH ARGV[from..to] onto a list, a thousand at a time (one command, not one a token;
# Lua's unpack has a stack limit).
_PUSH = """
local function push(key, from, to)
  while from <= to do
    local last = math.min(to, from + 999)
    redis.call('RPUSH', key, unpack(ARGV, from, last))
    from = last + 1
  end
end
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
    _PUSH
    + _FENCE
    + f"""
local first, n, flags = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[6]
local at = 6 + n
local have = redis.call('LLEN', KEYS[2])
if have < first then return 'lost:' .. have end
push(KEYS[2], 7 + have - first, 6 + n)
if string.find(flags, 'l', 1, true) then
  local lps = redis.call('LLEN', KEYS[3])
  if lps < first then return 'lost:' .. lps end
  push(KEYS[3], at + 1 + lps - first, at + n)
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
# length as the worker left it, worker, now, record TTL, '1' to move (trim the log to its
# last entry; and refresh its TTL, which 'e' alone does), the count and the (channel, frame) pairs to publish and log (the entry's
# fields: ``output_log.encode_frame``), then the ops: flags ('a' append, 'l' logprobs, 'p'
# prompt logprobs follow, 'f' final: state, finish_reason, error follow), entry, first index,
# token count n, logprob count, the tokens, the logprob entries, [prompt], [final].
# A log whose length is not the worker's (a claimer added its mark, or Redis lost its tail)
# writes nothing: {'check', length}; else {length, op number, refusal, ...}. (XLEN, not the
# last entry's id: XREVRANGE returns the whole entry, 15 us at 64 requests a step.)
STEP_SCRIPT = (
    _PUSH
    + f"""
local length = redis.call('XLEN', KEYS[1])
if length ~= tonumber(ARGV[1]) then return {{'check', length}} end
local nc, channels = tonumber(ARGV[6]), 7
local at = channels + 2 * nc
if nc > 0 then
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, channels, at - 1))
  if length == 0 then redis.call('EXPIRE', KEYS[1], ARGV[4]) end
  length = length + 1
end
local result, op = {{length}}, 0
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
    if not why then push(tk, t0 + have - first, t0 + n - 1) end
    if not why and nl > 0 then
      local lps = redis.call('LLEN', lk)
      if lps < first then why = 'lost:' .. lps end
      if not why then push(lk, t0 + n + lps - first, t0 + n + nl - 1) end
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
if ARGV[5] == '1' and length > 1 then
  redis.call('XTRIM', KEYS[1], 'MAXLEN', 1)
  result[1] = 1
end
if ARGV[5] ~= '0' then redis.call('EXPIRE', KEYS[1], ARGV[4]) end
return result
"""
)

# Lua: a request's value in a log entry's fields (frames, ``output_log.encode_frame``), or nil
# (none, or a JSON message: its tokens went to the list).
_VALUE_OF = """
local function value_of(fields, rid)
  for i = 2, #fields, 2 do
    local s = fields[i]
    local _, stop = string.find(s, '\\30' .. rid .. '\\31', 1, true)
    if stop then
      local next_one = string.find(s, '\\30', stop + 1, true)
      local v = string.sub(s, stop + 1, (next_one or 0) - 1)
      if string.sub(v, 1, 1) == '{' then return nil end
      return v
    end
  end
  return nil
end
"""

# Lua: move into a request's list (tk, lk: its tokens and logprobs) what the log ``log`` holds
# of it past the list's end, in log order (a value past a hole ends it). Returns the length.
_ABSORB = """
local function absorb(log, rid, tk, lk)
  local have, lps = redis.call('LLEN', tk), redis.call('LLEN', lk)
  for _, e in ipairs(redis.call('XRANGE', log, '-', '+')) do
    local v = value_of(e[2], rid)
    if v then
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
  return have
end
"""

# Requests taken into service (pulled, claimed or resumed), in one call: each owned by this
# worker unless another took it over meanwhile (or it runs under another entry now). KEYS: the
# stream, each request's hash. ARGV: worker, now, each request's entry. Returns one reply a
# request: 0, or 'fenced:<owner>'.
RUNNING_SCRIPT = f"""
local replies = {{}}
for i = 2, #KEYS do
  local entry = ARGV[i + 1]
  local own = redis.call('HMGET', KEYS[i], 'worker', 'entry')
  if own[2] and own[2] ~= entry then
    redis.call('XACK', KEYS[1], '{GROUP}', entry)
    redis.call('XDEL', KEYS[1], entry)
    replies[i - 1] = 'fenced:' .. (own[1] or '')
  elseif own[1] and own[1] ~= ARGV[1] then
    replies[i - 1] = 'fenced:' .. own[1]
  else
    redis.call('HSET', KEYS[i], 'state', 'running', 'worker', ARGV[1], 'entry', entry,
      'started', ARGV[2])
    replies[i - 1] = 0
  end
end
return replies
"""

# Take over one entry of a dead worker, with its request: XCLAIM (only if still idle for
# ARGV[3] ms, so a second claimer loses the race), the old owner's log tail moved into the
# request's list and the log marked (the old owner, if it wakes, finds its log changed), the
# new owner in the hash, and the tokens recorded, atomically, so the claimer resumes from
# exactly what the old owner's clients saw. KEYS: stream, req, tokens, logprobs. ARGV: group,
# worker, min idle, entry, log key prefix, request id, log TTL. Returns false (not claimed),
# 'stale' (an entry its request no longer runs under: dropped), or {fields, state, tokens}.
CLAIM_SCRIPT = (
    _VALUE_OF
    + _ABSORB
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
    _VALUE_OF
    + _ABSORB
    + """
absorb(ARGV[1], ARGV[2], KEYS[2], KEYS[3])
return {redis.call('HGET', KEYS[1], 'state') or '', redis.call('LRANGE', KEYS[2], 0, -1)}
"""
)

# A reader's view of a request, in one atomic read: its hash, its list of tokens (and
# logprobs, with ARGV[3] = '1'), and the values its owner's log holds for it. KEYS: req,
# tokens, logprobs. ARGV: log key prefix, request id, '1' for logprobs.
READ_SCRIPT = (
    _VALUE_OF
    + """
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
    local v = value_of(e[2], ARGV[2])
    if v then values[#values + 1] = v end
  end
end
return {h, redis.call('LRANGE', KEYS[2], 0, -1), lps, values}
"""
)


def sharded(script: str) -> str:
    """The script publishing on sharded channels (a Redis Cluster's SPUBLISH)."""
    return script.replace("redis.call('PUBLISH'", "redis.call('SPUBLISH'")
