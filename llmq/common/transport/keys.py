"""Every Redis key name (and the API's Lua scripts; the output's are in ``scripts``): the one
module that knows how keys are spelled.

Everything stored is JSON or plain text, so redis-cli shows a person what is happening
(``{p}`` is the key prefix, ``llmq`` unless set; on a Redis Cluster a model's keys read
``{p}:{<model>}:requests``, ``{p}:{<model>}:req:{id}``, ... and the others ``{<p>}:...``: see
``Keys``):

- ``{p}:requests:{model}``         stream per model, consumer group ``engines``: one entry per
                                   request (fields ``id``, ``kind``, ``payload`` = EngineRequest
                                   JSON, and ``target``: the worker placement chose, to which
                                   another worker that reads it hands it over with XCLAIM)
- ``{p}:cached:{worker}``          set (TTL): the block hashes a worker's prefix cache holds
                                   (``common/block_hashes``), which placement matches prompts to
- ``{p}:replies:{replica}``        pub/sub channel of one API process (or batch task process):
                                   one message a step per worker, a frame of every request it
                                   enqueued (``output_log.encode_frame``)
- ``{p}:out:{id}``                 pub/sub channel of a request that names none (one written
                                   with redis-cli): the same messages, for it alone
- ``{p}:cancel``                   pub/sub channel: ids of requests to abort,
                                   ``handback:{worker}`` from a worker leaving requests behind,
                                   and ``handover:{worker}`` to a worker handed requests
- ``{p}:req:{id}``                 hash (TTL): state, worker (its owner: see _FENCE), entry (its
                                   live stream entry), finish_reason, timings
- ``{p}:req:{id}:tokens``          list (TTL): the tokens generated (and their logprobs, when
                                   asked), one value a move of its worker's log
                                   (``output_log.encode_value``): recovery, gaps
- ``{p}:log:{worker}``             stream (TTL): one entry a step, the frames it published (a
                                   field per channel); moved into the lists and trimmed every 64
                                   steps; a claimer marks it ``~claimed``
- ``{p}:engines:{worker}``         hash (TTL = heartbeat): model, KV blocks, running, waiting, ...
- ``{p}:engines``                  sorted set: worker -> time of its last heartbeat (the registry
                                   the API reads live engines from, instead of a SCAN)
- ``{p}:dead``                     stream: requests delivered too often, with the reason
- ``{p}:models``                   hash: every model a worker has served -> JSON source, kind
- ``{p}:loading``                  hash: worker -> JSON model, source, since, until: a worker
                                   loading its model (renewed until it serves or dies)
- ``{p}:catalogue``, ``{p}:wanted``, ``{p}:load:{model}``, ``{p}:load_failed``,
  ``{p}:keep_alive``, ``{p}:resident``, ``{p}:unload``, ``{p}:sleep``
                                   models on demand (``common/catalogue``): what may load, what
                                   requests wait for, who loads it, failed loads, keep-alives,
                                   what workers hold, unloads and sleeps asked for
- ``{p}:loras``                    hash: every LoRA adapter offered -> JSON base model, folder,
                                   owner (``common/lora_adapters.AdapterRecord``)
- ``{p}:files:{id}``, ``{p}:files:{id}:content``, ``{p}:files:expiry``
                                   OpenAI Batch API files: object hash (with its ``owner``),
                                   content as a list of pieces of at most 1 MiB (both with a
                                   TTL a week past the retention, a safety net), and every file
                                   by the time its retention ends (the sweep that deletes it
                                   and gives its bytes back to its owner)
- ``{p}:batches:active``, ``{p}:batches:{id}``, ``{p}:batches:{id}:results``,
  ``{p}:batches:{id}:attempts``, ``{p}:batches:{id}:lease``, ``{p}:batches:{id}:dispatch``
                                   OpenAI Batch API batches: those not final, object hash (with
                                   its ``owner``; TTL: window + retention), line results and the
                                   attempt of lines that were retried (TTL, deleted when the
                                   batch ends), the running task's lease, a re-dispatch marker
- ``{p}:tenants:{owner}:files``, ``{p}:tenants:{owner}:batches``, ``{p}:tenants:{owner}:bytes``
                                   per tenant (owner id of an API key): its files and batches
                                   (sorted sets by creation, what lists page through) and the
                                   bytes its files hold (counted against its quota)
"""

from __future__ import annotations

GROUP = "engines"
# On the cancel channel, never a request id: a worker shutting down left requests pending.
HANDBACK_PREFIX = "handback:"
# On the cancel channel: requests were handed over to this worker (they are in its pending list).
HANDOVER_PREFIX = "handover:"


class Keys:
    """Key names. In a Redis Cluster (``cluster``) keys carry hash tags: everything of one
    model (its stream, its requests' records, its workers' logs, its reply channels) in the
    slot of ``{model}``, so that one script can touch all one step needs; every other key
    (engines, files, batches, tenants, responses) in the slot of ``{prefix}``. A model's keys
    need the model: ``for_model``."""

    def __init__(self, prefix: str = "llmq", cluster: bool = False, model: str | None = None):
        self.prefix = prefix
        self.cluster = cluster
        self.model = model
        self._g = "{" + prefix + "}" if cluster else prefix

    def for_model(self, model: str) -> Keys:
        """The keys of one model's requests."""
        if self.cluster and ("{" in model or "}" in model):
            raise ValueError(f"a model served on a Redis Cluster cannot have braces: {model!r}")
        return Keys(self.prefix, self.cluster, model)

    def _m(self, model: str | None = None) -> str:
        """The prefix of a model's keys (tagged with it in a cluster)."""
        model = model if model is not None else self.model
        if not self.cluster:
            return self.prefix
        if model is None:
            raise ValueError("in a Redis Cluster a request's keys need its model (for_model)")
        return f"{self.prefix}:{{{model}}}"

    def requests(self, model: str) -> str:
        """One stream per served model: a worker joins the stream of the model it serves."""
        if self.cluster:
            return f"{self._m(model)}:requests"
        return f"{self.prefix}:requests:{model}"

    @property
    def requests_pattern(self) -> str:
        return f"{self.prefix}:{{*}}:requests" if self.cluster else f"{self.prefix}:requests:*"

    def out(self, request_id: str) -> str:
        return f"{self._m()}:out:{request_id}"

    def replies(self, replica: str) -> str:
        """One API process's channel: the output of every request it enqueued (a model's, in
        a cluster: a sharded channel in the model's slot)."""
        return f"{self._m()}:replies:{replica}"

    def log(self, worker: str) -> str:
        """A worker's step log: the tail of its requests' output (``output_log``)."""
        return f"{self.log_prefix}{worker}"

    def cached(self, worker: str) -> str:
        """Set: the block hashes a worker's prefix cache holds (in its model's slot)."""
        return f"{self._m()}:cached:{worker}"

    @property
    def log_prefix(self) -> str:
        return f"{self._m()}:log:"

    @property
    def cancel(self) -> str:
        return f"{self._g}:cancel"

    def req(self, request_id: str) -> str:
        return f"{self._m()}:req:{request_id}"

    def tokens(self, request_id: str) -> str:
        return f"{self._m()}:req:{request_id}:tokens"

    def image(self, digest: str) -> str:
        """An image's bytes, by their SHA-256 (``common/images``), in its model's slot."""
        return f"{self._m()}:image:{digest}"

    def engine(self, worker: str) -> str:
        return f"{self._g}:engines:{worker}"

    @property
    def engines_index(self) -> str:
        """Sorted set: every worker that wrote a heartbeat -> the time of its last one."""
        return f"{self._g}:engines"

    @property
    def dead(self) -> str:
        return f"{self._g}:dead"

    # OpenAI Batch API objects (common/storage/store.py)
    def file(self, file_id: str) -> str:
        return f"{self._g}:files:{file_id}"

    def file_content(self, file_id: str) -> str:
        """List: the file's content in pieces (common/storage/file_chunks.py)."""
        return f"{self._g}:files:{file_id}:content"

    @property
    def files_expiry(self) -> str:
        """Sorted set: every file -> the time its retention ends."""
        return f"{self._g}:files:expiry"

    def batch(self, batch_id: str) -> str:
        return f"{self._g}:batches:{batch_id}"

    def batch_results(self, batch_id: str) -> str:
        """Hash: line number -> output line (checkpoint: a line is run at most once)."""
        return f"{self._g}:batches:{batch_id}:results"

    def batch_attempts(self, batch_id: str) -> str:
        """Hash: line number -> its current attempt, for lines retried after a temporary
        error (each attempt has its own request ids)."""
        return f"{self._g}:batches:{batch_id}:attempts"

    def batch_lease(self, batch_id: str) -> str:
        return f"{self._g}:batches:{batch_id}:lease"

    def batch_dispatch(self, batch_id: str) -> str:
        """Short-lived marker: a worker has just re-dispatched this batch's task."""
        return f"{self._g}:batches:{batch_id}:dispatch"

    @property
    def batches_active(self) -> str:
        """Set of batches not yet in a final state (for re-dispatch when a lease expires)."""
        return f"{self._g}:batches:active"

    # Stored responses of the Responses API (common/storage/responses_store.py)
    def response(self, response_id: str) -> str:
        return f"{self._g}:responses:{response_id}"

    # Per tenant: an index each (a tenant's list pages through its own objects only) and the
    # bytes its files hold.
    def tenant_files(self, owner: str) -> str:
        return f"{self._g}:tenants:{owner}:files"

    def tenant_batches(self, owner: str) -> str:
        return f"{self._g}:tenants:{owner}:batches"

    def tenant_bytes(self, owner: str) -> str:
        return f"{self._g}:tenants:{owner}:bytes"

    @property
    def loras(self) -> str:
        """Hash: LoRA adapter name -> AdapterRecord JSON (its base model, folder, owner)."""
        return f"{self._g}:loras"

    @property
    def models(self) -> str:
        """Hash: every model a worker has served -> JSON {source, kind, max_model_len}."""
        return f"{self._g}:models"

    @property
    def loading(self) -> str:
        """Hash: worker -> JSON {model, source, since, until} while it loads its model (until:
        when the announcement runs out unless renewed)."""
        return f"{self._g}:loading"

    @property
    def catalogue(self) -> str:
        """Hash: model a worker may load on demand -> JSON {source, size}."""
        return f"{self._g}:catalogue"

    @property
    def wanted(self) -> str:
        """Hash: model a request waits for and no worker holds -> JSON {since, until}."""
        return f"{self._g}:wanted"

    def load_claim(self, model: str) -> str:
        """String (TTL, renewed while loading): the worker loading ``model``."""
        return f"{self._g}:load:{model}"

    @property
    def load_failed(self) -> str:
        """Hash: model whose last load failed -> JSON {error, at, worker}."""
        return f"{self._g}:load_failed"

    @property
    def keep_alive(self) -> str:
        """Hash: model -> seconds it stays loaded after its last request (-1: for good)."""
        return f"{self._g}:keep_alive"

    @property
    def resident(self) -> str:
        """Hash: engine -> JSON {model, worker, size, expires_at}: models loaded on demand."""
        return f"{self._g}:resident"

    @property
    def unload(self) -> str:
        """Hash: model -> time an unload was asked for (workers unload it once idle)."""
        return f"{self._g}:unload"

    @property
    def sleep(self) -> str:
        """Hash: model -> time a sleep was asked for (workers holding it put it to sleep once
        idle)."""
        return f"{self._g}:sleep"


# ARGV[12]: the worker placement chose for it ('' none: whichever reads it first).
# ARGV[11]: where its output goes (its ``reply_to``: readers find its values in a worker's log
# by it). Enqueue only while the ARGV[10] slots a request needs (its prompts x n, counted at its first
# choice) fit under ARGV[3] entries waiting undelivered (XLEN minus the pending ones: finished
# entries are deleted), atomically, so the limit holds across API replicas. With
# ARGV[9] = '1' a request whose id is already live or finished is attached to, not re-sent
# (a batch task re-run after its worker died follows the lines its first run started); the
# hash's 'attach' keeps it: such a request may have a record, which a fresh one never has
# (PULLED_SCRIPT reads the record of the first kind only). XPENDING only when XLEN alone
# (the running entries counted too) passes the limit: a command saved per request.
ENQUEUE_SCRIPT = """
local stream, req = KEYS[1], KEYS[2]
if ARGV[9] == '1' then
  local state = redis.call('HGET', req, 'state')
  if state == 'queued' or state == 'running' or state == 'finished' then return 'attached' end
end
local limit = tonumber(ARGV[3])
if limit > 0 then
  local waiting = redis.call('XLEN', stream)
  if waiting + tonumber(ARGV[10]) > limit then  -- the running ones counted: look closer
    local ok, pending = pcall(redis.call, 'XPENDING', stream, ARGV[4])
    if ok then waiting = waiting - pending[1] end
    if waiting + tonumber(ARGV[10]) > limit then return false end
  end
end
-- XADD first: a script's first write is where Redis refuses it under maxmemory (an HDEL, never
-- refused, would let every write after it through). 'worker' goes only from a request sent
-- again under its id (a fresh id has none): a command saved per request.
local entry
if ARGV[12] and ARGV[12] ~= '' then  -- placed: the worker chosen, which a reader hands it to
  entry = redis.call('XADD', stream, '*', 'id', ARGV[1], 'kind', ARGV[8], 'payload', ARGV[2],
    'target', ARGV[12])
else
  entry = redis.call('XADD', stream, '*', 'id', ARGV[1], 'kind', ARGV[8], 'payload', ARGV[2])
end
redis.call('HSET', req, 'state', 'queued', 'created', ARGV[5], 'model', ARGV[6], 'entry', entry,
  'reply', ARGV[11] or '', 'attach', ARGV[9])
if ARGV[9] == '1' then redis.call('HDEL', req, 'worker') end
redis.call('EXPIRE', req, ARGV[7])
return entry
"""

# Mark a live request cancelled (a worker that pulls it later drops it) and tell the engines
# (on the cancel channel ARGV[2]: a channel, not a key, in a cluster's other slot).
CANCEL_SCRIPT = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'queued' or state == 'running' then redis.call('HSET', KEYS[1], 'state', 'cancelled') end
return redis.call('PUBLISH', ARGV[2], ARGV[1])
"""


# Count ARGV[1] more bytes against a tenant's quota ARGV[2] (0: none), unless that passes it.
# Returns {1, bytes now} or {0, bytes held}: the check and the count are one step, so two
# uploads at once cannot both pass the last room.
RESERVE_BYTES_SCRIPT = """
local held = tonumber(redis.call('GET', KEYS[1]) or '0')
local limit = tonumber(ARGV[2])
if limit > 0 and held + tonumber(ARGV[1]) > limit then return {0, held} end
return {1, redis.call('INCRBY', KEYS[1], ARGV[1])}
"""

# Delete a file (object hash KEYS[1], content KEYS[4]) if tenant ARGV[2] owns it (one without
# an owner field is ARGV[3]'s, the anonymous tenant's), drop it from the tenant's index and
# give its bytes back; 0 when it is not there or not the tenant's, so of two deletes racing
# one gives back. KEYS[5], the retention index, forgets it too.
RELEASE_FILE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local owner = redis.call('HGET', KEYS[1], 'owner') or ARGV[3]
if owner ~= ARGV[2] then return 0 end
local bytes = redis.call('HGET', KEYS[1], 'bytes') or '0'
redis.call('DEL', KEYS[1], KEYS[4])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
if redis.call('DECRBY', KEYS[3], bytes) <= 0 then redis.call('DEL', KEYS[3]) end
return 1
"""


def as_text(value) -> str:
    """A Redis reply (bytes, or already str) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
