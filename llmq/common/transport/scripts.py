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
# step's plain writes are fenced once for all its requests: STEP_SCRIPT.) Lua: nil, or
# 'fenced:<owner>' (an entry no longer the request's is acknowledged and deleted); ``refuse``
# judges an owner and entry already read (HMGET's first two values).
_FENCE = f"""
local function refuse(own, entry, worker, stream)
  if own[2] and own[2] ~= entry then
    redis.call('XACK', stream, '{GROUP}', entry)
    redis.call('XDEL', stream, entry)
    return 'fenced:' .. (own[1] or '')
  end
  if own[1] and own[1] ~= worker then return 'fenced:' .. own[1] end
  return nil
end
local function fence(req, entry, worker, stream)
  return refuse(redis.call('HMGET', req, 'worker', 'entry'), entry, worker, stream)
end
"""

# Lua: the first index of a value (``output_log.encode_value``) and the index after its last
# token (nil for a string that is not a value); and where a request's record ends, from its
# last value alone (LINDEX -1, O(1)): 0 for none, or for a last element that is not a value.
_RECORDED = """
local function span(v)
  local a = string.find(v, '|', 1, true)
  if not a then return nil end
  local b = string.find(v, '|', a + 1, true)
  local first = tonumber(string.sub(v, 1, a - 1)) or 0
  local tokens = string.sub(v, a + 1, (b or 0) - 1)
  if tokens == '' then return first, first end
  local _, commas = string.gsub(tokens, ',', '')
  return first, first + commas + 1
end
local function recorded(tk)
  local last = redis.call('LINDEX', tk, -1)
  if not last then return 0 end
  local _, stop = span(last)
  return stop or 0
end
"""

# One request's news written alone (a worker's first writes, and every write after its log
# changed under it: a claim, or Redis lost its tail). KEYS: req, tokens, channel, stream.
# ARGV: worker, entry, index, token count n, payload (published unless flag 'q'), flags ('p':
# the prompt logprobs follow, 'f': final, 'q': record only), the record's value for the n
# tokens from index (``output_log.encode_value``), [prompt logprobs], [final state,
# finish_reason, error, finished time, record TTL]. A value already recorded is not recorded
# again (a write sent again after a dropped connection); a record that ends before ``index``
# lost its tail (Redis restarted without it): nothing is recorded out of place, and
# 'lost:<length>' says so.
WRITE_SCRIPT = (
    _RECORDED
    + _FENCE
    + f"""
local fenced = fence(KEYS[1], ARGV[2], ARGV[1], KEYS[4])
if fenced then return fenced end
local first, n, flags = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[6]
local at = 7
local have = recorded(KEYS[2])
if have < first then return 'lost:' .. have end
if n > 0 and have < first + n then redis.call('RPUSH', KEYS[2], ARGV[7]) end
if string.find(flags, 'p', 1, true) then
  redis.call('HSET', KEYS[1], 'prompt_logprobs', ARGV[at + 1])
  at = at + 1
end
if not string.find(flags, 'q', 1, true) then redis.call('PUBLISH', KEYS[3], ARGV[5]) end
if string.find(flags, 'f', 1, true) then
  redis.call('HSET', KEYS[1], 'state', ARGV[at + 1], 'finish_reason', ARGV[at + 2],
    'finished', ARGV[at + 4], 'error', ARGV[at + 3])
  redis.call('EXPIRE', KEYS[1], ARGV[at + 5])
  redis.call('EXPIRE', KEYS[2], ARGV[at + 5])
  redis.call('XACK', KEYS[4], '{GROUP}', ARGV[2])
  redis.call('XDEL', KEYS[4], ARGV[2])
end
return 0
"""
)

# One step of a worker, every request's news in one call, a few commands whatever the batch.
# KEYS: the worker's log, its stream, then req and tokens of each op. ARGV: the log's length
# as the worker left it, worker, now, record TTL, '1' to move (trim the log to its last entry;
# and refresh its TTL, which 'e' alone does), the count and the (channel, frame) pairs to
# publish and log (the entry's fields: ``output_log.encode_frame``), then the ops: flags ('a'
# a move, 'p' prompt logprobs follow, 'f' final: state, finish_reason, error follow), entry,
# first index, token count n, the record's value for them, [prompt], [final]. One value a
# request, not a token an argument: passing tokens one by one into Lua was a third of Redis's
# instructions (callgrind). A log whose length is not the worker's (a claimer added its mark,
# or Redis lost its tail) writes nothing: {'check', length}; else {length, op number, refusal,
# ...}. (XLEN, not the last entry's id: XREVRANGE returns the whole entry.)
STEP_SCRIPT = (
    _RECORDED
    + _FENCE
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
  local req, tk = KEYS[3 + 2 * op], KEYS[4 + 2 * op]
  op = op + 1
  local flags, entry, first, n = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3])
  local value = ARGV[at + 4]
  at = at + 5
  local why
  if string.find(flags, 'f', 1, true) then why = fence(req, entry, ARGV[2], KEYS[2]) end
  if not why then
    local have = recorded(tk)
    if have < first then why = 'lost:' .. have
    elseif n > 0 and have < first + n then redis.call('RPUSH', tk, value) end
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

# Lua: where a request's output goes (its hash's ``reply``: ``<channel>#<key>``; none: its own
# channel ``out``, under its id), and its value in a log entry's fields (a frame per channel,
# ``output_log.encode_frame``), or nil (none, or a JSON message: its tokens went to the list).
_VALUE_OF = """
local function address(reply, rid, out)
  if not reply or reply == '' then return out, rid end
  local hash = string.find(reply, '#', 1, true)
  if not hash then return reply, rid end
  return string.sub(reply, 1, hash - 1), string.sub(reply, hash + 1)
end
local function value_of(fields, channel, key)
  for i = 1, #fields - 1, 2 do
    if fields[i] == channel then
      local s = fields[i + 1]
      local _, stop = string.find(s, '\\30' .. key .. '\\31', 1, true)
      if not stop then return nil end
      local next_one = string.find(s, '\\30', stop + 1, true)
      local v = string.sub(s, stop + 1, (next_one or 0) - 1)
      if string.sub(v, 1, 1) == '{' then return nil end
      return v
    end
  end
  return nil
end
"""

# Lua: move into a request's record (tk) the values the log ``log`` holds of it past the
# record's end, in log order (a value past a hole ends it), each whole. Returns the end.
_ABSORB = (
    _RECORDED
    + """
local function absorb(log, channel, key, tk)
  local have = recorded(tk)
  for _, e in ipairs(redis.call('XRANGE', log, '-', '+')) do
    local v = value_of(e[2], channel, key)
    if v then
      local first, stop = span(v)
      if first > have then return have end
      if stop > have then
        redis.call('RPUSH', tk, v)
        have = stop
      end
    end
  end
  return have
end
"""
)

# Requests taken into service (pulled, claimed or resumed), in one call: each owned by this
# worker unless another took it over meanwhile (or it runs under another entry now). KEYS: the
# stream, each request's hash. ARGV: worker, now, each request's entry. Returns one reply a
# request: 0, or 'fenced:<owner>'.
RUNNING_SCRIPT = (
    _FENCE
    + """
local replies = {}
for i = 2, #KEYS do
  local entry = ARGV[i + 1]
  local fenced = fence(KEYS[i], entry, ARGV[1], KEYS[1])
  if fenced then
    replies[i - 1] = fenced
  else
    redis.call('HSET', KEYS[i], 'state', 'running', 'worker', ARGV[1], 'entry', entry,
      'started', ARGV[2])
    replies[i - 1] = 0
  end
end
return replies
"""
)

# Requests just read from the stream, taken into service in one call: each one's state and,
# where it may have one, its record (a hash ENQUEUE did not write, or one sent again under its
# id: a fresh request has none, and skipping its LRANGE saves a command); each owned by this
# worker and running, unless cancelled, or refused as RUNNING_SCRIPT refuses. KEYS: stream,
# then req and tokens of each. ARGV: worker, now, each entry. Returns {0 or 'fenced:<owner>',
# state, record values} a request.
PULLED_SCRIPT = (
    _FENCE
    + """
local replies = {}
for i = 1, (#KEYS - 1) / 2 do
  local req, tk, entry = KEYS[2 * i], KEYS[2 * i + 1], ARGV[2 + i]
  local own = redis.call('HMGET', req, 'worker', 'entry', 'state', 'created', 'attach')
  local why = refuse(own, entry, ARGV[1], KEYS[1])
  local values = {}
  if not why then
    if own[1] or not own[4] or own[5] == '1' then values = redis.call('LRANGE', tk, 0, -1) end
    if own[3] ~= 'cancelled' then
      redis.call('HSET', req, 'state', 'running', 'worker', ARGV[1], 'entry', entry,
        'started', ARGV[2])
    end
  end
  replies[i] = {why or 0, own[3] or '', values}
end
return replies
"""
)

# Take over one entry of a dead worker, with its request: XCLAIM (only if still idle for
# ARGV[3] ms, so a second claimer loses the race), the old owner's log tail moved into the
# request's list and the log marked (the old owner, if it wakes, finds its log changed), the
# new owner in the hash, and the tokens recorded, atomically, so the claimer resumes from
# exactly what the old owner's clients saw. KEYS: stream, req, tokens. ARGV: group,
# worker, min idle, entry, log key prefix, request id, log TTL, the request's own channel.
# Returns false (not claimed),
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
local own = redis.call('HMGET', KEYS[2], 'entry', 'worker', 'state', 'reply')
if own[1] and own[1] ~= ARGV[4] then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[4])
  redis.call('XDEL', KEYS[1], ARGV[4])
  return 'stale'
end
if own[2] and own[2] ~= ARGV[2] then
  local log = ARGV[5] .. own[2]
  local channel, key = address(own[4], ARGV[6], ARGV[8])
  absorb(log, channel, key, KEYS[3])
  redis.call('XADD', log, '*', '{CLAIM_MARK}', ARGV[6])
  redis.call('EXPIRE', log, ARGV[7])
end
redis.call('HSET', KEYS[2], 'worker', ARGV[2])
return {{got[1][2], own[3] or '', redis.call('LRANGE', KEYS[3], 0, -1)}}
"""
)

# A worker restarted under its name takes its own requests back: their tails in its log move
# into their records first. KEYS: req, tokens. ARGV: log key, request id, its own channel.
# Returns {state, the record's values}.
TAKE_SCRIPT = (
    _VALUE_OF
    + _ABSORB
    + """
local channel, key = address(redis.call('HGET', KEYS[1], 'reply'), ARGV[2], ARGV[3])
absorb(ARGV[1], channel, key, KEYS[2])
return {redis.call('HGET', KEYS[1], 'state') or '', redis.call('LRANGE', KEYS[2], 0, -1)}
"""
)

# A reader's view of a request, in one atomic read: its hash, its record's values, and the
# values its owner's log holds for it. KEYS: req, tokens. ARGV: log key prefix, request id,
# its own channel.
READ_SCRIPT = (
    _VALUE_OF
    + """
local h = redis.call('HGETALL', KEYS[1])
local worker, reply
for i = 1, #h - 1, 2 do
  if h[i] == 'worker' then worker = h[i + 1] end
  if h[i] == 'reply' then reply = h[i + 1] end
end
local values = {}
if worker then
  local channel, key = address(reply, ARGV[2], ARGV[3])
  for _, e in ipairs(redis.call('XRANGE', ARGV[1] .. worker, '-', '+')) do
    local v = value_of(e[2], channel, key)
    if v then values[#values + 1] = v end
  end
end
return {h, redis.call('LRANGE', KEYS[2], 0, -1), values}
"""
)


# Hand an entry this worker read over to the worker placement chose for it: moved from this
# worker's pending list into the target's (XCLAIM JUSTID: its delivery count stays), only while
# it is still in this worker's list and its request has no owner (a worker frozen between its
# read and this call may find its entries claimed and running elsewhere: they stay where they
# are). KEYS: stream, req. ARGV: group, worker, target, entry. Returns 1 when handed over.
HANDOVER_SCRIPT = """
local mine = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[4], 1, ARGV[2])
if #mine == 0 or redis.call('HEXISTS', KEYS[2], 'worker') == 1 then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[4], 'JUSTID')
return 1
"""


def sharded(script: str) -> str:
    """The script publishing on sharded channels (a Redis Cluster's SPUBLISH)."""
    return script.replace("redis.call('PUBLISH'", "redis.call('SPUBLISH'")
