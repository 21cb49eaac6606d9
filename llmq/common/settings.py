"""The one place llmq reads its configuration: environment (prefix ``LLMQ_``), a ``.env`` file,
and CLI flags that override both. Nothing else reads ``os.environ`` for settings (the embedded
Redis's state file, ``embedded_redis``, is found through the runtime directory)."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmq.common.transport.embedded_redis import embedded_redis_url

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LLMQ_", env_file=".env", extra="ignore", protected_namespaces=()
    )

    # What is served
    model: str = Field(DEFAULT_MODEL, description="Hugging Face model id or local path to serve.")
    served_model_name: str | None = Field(
        None,
        description="Name clients use in `model` (vLLM's --served-model-name); unset: LLMQ_MODEL "
        "as given (`llmq up`: its short id, `smollm2-135m-instruct`). Every model also answers "
        "to its short id (its folder's or file's name, lower-case, without a GGUF's "
        "quantization) and its path or hub id.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights and KV cache dtype; auto: float16 on CUDA, bfloat16 on a CPU with "
        "bfloat16 in hardware (AVX512-BF16, AMX, Arm BF16), else float32.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model runs; auto picks cuda when available."
    )
    quantization: Literal["none", "int8", "int4", "fp8"] = Field(
        "none",
        description="Weights quantized at load (on llmq's fast forward: the families it "
        "serves): int8, int8 weights with a scale per group of 32 (Q8_0's form; per channel on "
        "CUDA); int4, 4-bit in groups of 32 with the head and the tensors Q4_K_M keeps in Q6_K "
        "at 6 bits (8 where llmq's integer kernels do not serve); fp8, float8 e4m3 projections with a scale per channel, the activations quantized "
        "to float8 per row (vLLM's fp8; a GPU of compute capability 8.9+). On a CPU with "
        "AVX512-VNNI or AVX2 the activations are quantized to int8 per block of 32 (W8A8, "
        "W4A8), else "
        "they enter torch's kernels in bfloat16 (on CUDA: int4 on tinygemm, int8 W8A8 on "
        "torch._int_mm). A GGUF model is served as its file is quantized, on the CPU.",
    )
    max_model_len: int | None = Field(
        None, description="Longest prompt plus output in tokens; defaults to the model's own limit."
    )
    lora_modules: str = Field(
        "",
        description="LoRA adapters served on the base model from the start, as "
        "`name=path,name=path` (PEFT folders: adapter_config.json and "
        "adapter_model.safetensors); each is offered as a model of its own. More load and "
        "unload at run time through POST /v1/load_lora_adapter and /v1/unload_lora_adapter.",
    )
    max_lora_rank: int = Field(
        64, ge=1, description="Largest LoRA rank an adapter may have; a larger one is refused."
    )
    speculative_method: Literal["off", "ngram", "draft", "suffix"] = Field(
        "off",
        description="Speculative decoding: `ngram` proposes the tokens that followed the last "
        "few tokens' latest earlier occurrence in the request's prompt and output; `draft`, "
        "the tokens a smaller model with the same tokenizer (LLMQ_SPECULATIVE_MODEL) "
        "generates; `suffix`, the most frequent continuation of the longest match in the "
        "request's prompt and output and in recent requests' outputs. The model checks them "
        "several at a time; output is unchanged (a request turns it off with "
        '`"speculative": false`).',
    )
    speculative_model: str = Field(
        "",
        description="The draft model of `draft` speculation (a folder or GGUF file, as "
        "LLMQ_MODEL): one with the served model's tokenizer, loaded in the same worker; the "
        "served model itself with LLMQ_SPECULATIVE_QUANTIZATION drafts as a smaller copy.",
    )
    speculative_quantization: Literal["none", "int8", "int4", "fp8"] = Field(
        "none", description="Quantization of the draft model at load, as LLMQ_QUANTIZATION."
    )
    speculative_suffix_requests: int = Field(
        256,
        ge=0,
        description="Finished requests whose outputs `suffix` speculation keeps to propose "
        "from (the oldest dropped first).",
    )
    speculative_tokens: int = Field(
        6, ge=0, description="Most proposed tokens a sequence has checked in one step."
    )
    speculative_ngram_min: int = Field(
        2, ge=1, description="Shortest run of last tokens the n-gram proposer looks up."
    )
    speculative_ngram_max: int = Field(
        4, ge=1, description="Longest run of last tokens the n-gram proposer looks up."
    )
    speculative_max_batch: int | None = Field(
        None,
        ge=0,
        description="Decoding sequences past which a step proposes nothing (default: "
        "LLMQ_MAX_BATCH_SIZE for `ngram` and `suffix`, 4 for `draft`, whose model drafts for "
        "each sequence). Below it each sequence drafts while its drafts are kept often enough "
        "to pay for their rows at the step costs the worker measures.",
    )
    max_loras: int = Field(
        8,
        ge=1,
        description="Adapters a worker keeps loaded at once; past it the least recently used one "
        "that no running request uses is dropped (and read from disk again when asked for).",
    )
    catalogue: str = Field(
        "",
        description="Models the fleet loads on demand, comma-separated: model folders, GGUF "
        "files, or directories whose model folders and GGUF files are each offered (named by "
        "short id). Set on a worker: it starts with no model (LLMQ_MODEL unused) and loads what "
        "requests name.",
    )
    model_memory_mb: float = Field(
        0,
        ge=0,
        description="Megabytes of models a worker with LLMQ_CATALOGUE holds at once (a model "
        "counts its files' size); the least recently used idle one is unloaded for room. 0: no "
        "limit.",
    )
    keep_alive: str = Field(
        "5m",
        description="How long a model loaded on demand stays loaded after its last request, as "
        "Ollama's keep_alive (`30s`, `5m`, `1h`, or seconds; 0 unloads it at once, -1 keeps "
        "it); a request's own keep_alive overrides it.",
    )
    sleep_idle_seconds: float = Field(
        0,
        ge=0,
        description="A model loaded on demand and idle this long is put to sleep: its memory "
        "given back, its place kept (its next request wakes it on the same worker). 0: never.",
    )
    tokenizer_cache_dir: str | None = Field(
        None,
        description="Where a GGUF file's tokenizer, converted once, is kept by the file's "
        "sha256 for every later start (worker and API); unset: $XDG_CACHE_HOME/llmq/tokenizers "
        "(~/.cache/llmq/tokenizers).",
    )

    # Engine budgets
    block_size: int = Field(16, description="Tokens per KV cache block.")
    kv_blocks: int | None = Field(
        None, ge=1, description="Number of KV cache blocks; wins over kv_cache_memory_gb."
    )
    kv_cache_memory_gb: float | None = Field(
        None,
        gt=0,
        description="KV cache size (GiB) when kv_blocks is unset; unset: sized to the batch, "
        "max_batch_size sequences of min(max_model_len, 1024) tokens (and at least one of "
        "max_model_len), within 2 GiB. On the CPU its memory becomes resident as blocks are "
        "first used; on a GPU all of it at start.",
    )
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = Field(
        "auto",
        description="How the KV cache stores keys and values: auto in the model's dtype; int8 "
        "or fp8 (float8 e4m3) as 8-bit codes with a float32 scale per token and KV head, "
        "quantized as they are written and dequantized as attention reads them. The same "
        "kv_cache_memory_gb then holds about 2x the tokens of a bfloat16 cache (4x of float32), "
        "at a small loss of accuracy. CUDA graphs and the fused C++ "
        "step are then off (they write the cache in the model's dtype).",
    )
    max_batch_size: int = Field(64, description="Most sequences in one engine step.")
    max_batch_tokens: int = Field(
        512, description="Most tokens in one engine step (prefill chunks plus decodes)."
    )
    max_prefill_tokens_with_decodes: int | None = Field(
        None,
        ge=1,
        description="Most prompt tokens in a step that also decodes (its length is every "
        "running stream's gap between tokens); unset: 128 on a CPU, max_batch_tokens on a GPU.",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV blocks of shared prompt prefixes."
    )
    prefix_cache_share: float = Field(
        1.0,
        ge=0,
        description="CPU: the KV pool is resident only where written; freed blocks kept for "
        "prefix reuse may add this many blocks per block of the busiest moment's before a new "
        "block evicts the oldest of them rather than write more of the pool (the cache may "
        "always fill a sixteenth of the pool).",
    )
    torch_threads: int | None = Field(
        None,
        description="torch intra-op threads of the worker; unset: torch's default (one per "
        "core). See small_step_threads for steps of few tokens.",
    )
    small_step_threads: int | None = Field(
        None,
        description="torch threads for CPU steps of fewer than 16 tokens (few streams: "
        "latency-bound) with packed weights; unset: torch_threads. `llmq up` sets it to all "
        "the cores for its CPU workers.",
    )
    fast_forward: bool = Field(
        True,
        description="Llama, Qwen2, Mistral, Qwen3, Phi-3, Gemma 2/3 and (on CPU) Qwen3-MoE and "
        "Mixtral models run llmq's lean decoder forward (fused projections, no per-module "
        "overhead); false: transformers' forward, with llmq's paged attention. Both give the "
        "same tokens.",
    )
    pack_weights: bool = Field(
        True,
        description="With fast_forward, bfloat16 on CPU: projection weights packed once, the "
        "model's own copies released: with cpu_kernels on an AVX512-BF16 CPU in the panels of "
        "llmq's own matmul (faster than oneDNN's, results within bfloat16 rounding), else in "
        "oneDNN's blocked layout (the same results as unpacked, faster matmuls).",
    )
    cuda_graphs: bool = Field(
        True,
        description="With fast_forward on CUDA: decode-only steps replayed from CUDA graphs "
        "captured once per batch and context bucket (one launch per step instead of hundreds); "
        "contexts past 4096 tokens run eagerly.",
    )
    cpu_kernels: bool = Field(
        True,
        description="CPU: llmq's C++ kernels (`worker/runner/kernels/`, compiled with the "
        "system's g++ once, on first use, and cached in ~/.cache/llmq/kernels): every layer of "
        "a step in one C++ call, decode attention read straight from the paged KV pool, "
        "bfloat16 projections on llmq's own matmul (AVX512-BF16); without a compiler, or "
        "false: torch's ops.",
    )
    amx: bool = Field(
        True,
        description="CPU, llmq's bfloat16 matmul: its sums on AMX tiles where the CPU has them, "
        "the OS grants them and they time faster at load (every row count then takes them); "
        "false: vdpbf16ps or float32 FMAs, whichever times faster.",
    )
    int_activations: int = Field(
        2,
        ge=1,
        le=2,
        description="CPU, llmq's integer kernels (int8, int4, 6-bit and GGUF weights): the int8 "
        "terms each block of 32 activations is rounded into; 2 (default): a second term for "
        "what the first left, as close to the float model as float activations; 1: llama.cpp's "
        "Q8_1 rounding (faster at large batches, further from the model).",
    )
    int8_min: bool = Field(
        False,
        description="CPU, llmq's integer kernels: int8 at load (`LLMQ_QUANTIZATION=int8`) with "
        "a float16 scale and minimum per group of 32 (9 bits a weight) instead of Q8_0's "
        "symmetric scale (8.5): a float checkpoint dequantized from a Q4_1, Q4_K or Q5_0 "
        "file keeps its grid exactly (SmolLM2-135M's from its Q4_1 file served at the float "
        "model's top tokens, 0.031 of them apart with the symmetric scale); a lone stream's "
        "projections read 6% more bytes (0-12% slower measured).",
    )

    # Redis and processes
    redis_url: str | None = Field(
        None,
        description="Redis URL (redis:// or rediss://), or Redis Sentinel's as kombu takes it: "
        "`sentinel://[:PASSWORD@]HOST:26379;sentinel://HOST2:26379` (the password is the "
        "master's), or a Redis Cluster's: `redis+cluster://[:PASSWORD@]HOST:PORT,HOST2:PORT` "
        "(with LLMQ_CELERY_BROKER_URL); unset: `llmq up` starts an embedded Redis.",
    )
    celery_broker_url: str | None = Field(
        None,
        description="Redis URL of Celery's broker and result backend (batch tasks), when not "
        "LLMQ_REDIS_URL; required with a Redis Cluster, which Celery cannot use: one node, or "
        "a sentinel:// set, beside it.",
    )
    redis_sentinel_master: str = Field(
        "mymaster",
        description="With a sentinel:// Redis URL: the name the sentinels monitor the master "
        "under; every client (API, workers, Celery, Flower) follows it across failovers.",
    )
    key_prefix: str = Field("llmq", description="Prefix of every Redis key llmq uses.")
    worker_name: str | None = Field(
        None, description="Name of this worker in heartbeats and streams; default host:pid."
    )
    heartbeat_ttl: float = Field(
        5.0, description="Seconds a worker's heartbeat lives; a silent worker is dead after it."
    )
    stall_timeout: float = Field(
        120.0,
        description="Seconds a worker's engine loop may make no turn (a hung step) before its "
        "heartbeat is withheld and other workers take its requests over; 0: never.",
    )
    placement: bool = Field(
        True,
        description="Cache-aware placement: each request goes to the live worker expected to "
        "hold the longest prefix of its prompt, weighed against its load; off: whichever worker "
        "reads it first takes it.",
    )
    placement_load_weight: float = Field(
        0.25,
        ge=0,
        description="Placement's weight of a worker's load (tokens it has still to compute) "
        "against the prompt tokens its cache would spare: higher spreads more, 0 follows the "
        "cache alone. 0.25: a queued token costs a quarter of a prompt token computed again "
        "(its holder batches it with the rest, a miss computes the prefix twice); "
        "docs/performance.md (Cache-aware placement) compares the weights.",
    )
    max_deliveries: int = Field(
        3, description="Times a request may be delivered to workers before it is dead-lettered."
    )
    stream_interval_ms: float = Field(
        0.0,
        ge=0,
        description="Least milliseconds between two output messages of a worker: tokens wait, "
        "merged, until then (first tokens, final messages and errors go at once); fewer Redis "
        "calls for fast workers. 0: one message a step.",
    )
    request_ttl: int = Field(
        120, description="Seconds a finished request's record and tokens stay in Redis."
    )
    shutdown_grace: float = Field(
        5.0, description="Seconds a stopping worker finishes running requests before handing back."
    )
    workers: int | None = Field(
        None,
        description="Engine workers `llmq up` starts; unset: one per GPU on CUDA, one on a CPU "
        "with every core as its torch threads (one worker caches every prompt it serves; more "
        "share the cores as torch threads unless LLMQ_TORCH_THREADS says otherwise).",
    )

    # API
    host: str = Field("127.0.0.1", description="Address the API binds to.")
    port: int = Field(8000, ge=1, le=65535, description="Port the API listens on.")
    api_key: str | None = Field(
        None,
        description="Bearer token clients must send, or several separated by commas: one per "
        "tenant, each owning the files and batches made with it; unset: no auth.",
    )
    max_queue: int = Field(
        1024, description="Requests waiting in the queue beyond which the API answers 429."
    )
    request_timeout: float = Field(
        600.0, description="Seconds a request may take end to end before it fails with an error."
    )
    inactivity_timeout: float = Field(
        60.0,
        description="Seconds without output after which a running request fails, unless the "
        "worker running it keeps taking engine steps (a long prefill, or others' before its "
        "first token).",
    )
    no_worker_grace: float = Field(
        1.0,
        ge=0,
        description="Seconds a request queued or running for a model whose workers all died "
        "(heartbeats expired) waits for one to come back before it fails with 503 no_worker and "
        "is cancelled; batch lines wait however long it takes.",
    )
    max_body_bytes: int = Field(8 * 1024 * 1024, description="Largest HTTP request body accepted.")
    max_messages: int = Field(
        2048, ge=1, description="Most messages (or input items) in one chat request: 400 past it."
    )
    max_tools: int = Field(256, ge=0, description="Most tools offered in one request: 400 past it.")
    max_images: int = Field(
        16, ge=0, description="Most images in one request (all its turns together): 400 past it."
    )
    max_image_bytes: int = Field(
        10 * 1024 * 1024,
        ge=1,
        description="Largest image file accepted (a data URL's or base64 block's bytes, or a "
        "fetched link's body): 400 past it.",
    )
    max_image_pixels: int = Field(
        4096 * 4096,
        ge=1,
        description="Most pixels (width x height) of one image, read from its header before it "
        "is decoded: 400 past it.",
    )
    image_fetch_timeout: float = Field(
        10.0, gt=0, description="Seconds the API waits for an image link's bytes: 400 past it."
    )
    image_fetch_allow: str = Field(
        "",
        description="Hosts and networks (CIDR) the API may fetch image links from although they "
        "are private, loopback or link-local, comma-separated (e.g. `10.0.0.0/8,images.lan`); "
        "unset: only public addresses are fetched.",
    )
    image_ttl: int = Field(
        3600,
        ge=1,
        description="Seconds an image's bytes stay in Redis (stored once, by content hash) "
        "after the last request that sent it.",
    )
    tokenize_small_bytes: int = Field(
        64 * 1024,
        ge=0,
        description="Inputs (a prompt, a rendered chat, embedding inputs) up to this many UTF-8 "
        "bytes are tokenized on threads of their own, never behind larger ones.",
    )
    tokenize_bytes_in_flight: int = Field(
        2 * 1024 * 1024,
        ge=1,
        description="Bytes of larger inputs an API process tokenizes at once (tokenizing takes "
        "about 250 bytes of memory per byte of text); others wait for room.",
    )
    tokenize_wait: float = Field(
        2.0,
        ge=0,
        description="Seconds a large input waits for room to be tokenized before a 429 "
        "tokenizer_busy with Retry-After.",
    )
    tool_parser: Literal["hermes", "llama3_json", "mistral"] | None = Field(
        None,
        description="How tool calls are read from a model's output under tool_choice auto: "
        "hermes (<tool_call>{...}</tool_call>: Qwen2.5/3, SmolLM3), llama3_json, mistral "
        "([TOOL_CALLS][...]); unset: the format the chat template names, else none (text).",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3", "none"] | None = Field(
        None,
        description="How a reasoning model's thinking is told from its answer in chat "
        "(message.reasoning_content): deepseek_r1 and qwen3 (<think>...</think>, also when the "
        "template opens the block in the prompt); none: off, the thinking stays in content; "
        "unset: <think> when the chat template names </think>, else off.",
    )
    redis_max_connections: int = Field(
        256, description="Redis connections one API process opens at most (more requests wait)."
    )

    # Batch API
    max_file_bytes: int = Field(
        200 * 1024 * 1024,
        description="Largest file accepted by POST /v1/files (checked as it streams in: 400).",
    )
    max_batch_lines: int = Field(
        50_000,
        ge=1,
        description="Most requests (non-blank lines) in one batch input file, as OpenAI's "
        "limit (checked as the upload streams in: 400).",
    )
    file_retention: int = Field(
        30 * 24 * 3600,
        ge=60,
        description="Seconds files, finished batches and stored responses (/v1/responses) "
        "stay in Redis (OpenAI keeps output files and responses 30 days); a batch's input file "
        "is kept at least until its window ends.",
    )
    tenant_quota_bytes: int = Field(
        10 * 1024**3,
        ge=0,
        description="Bytes of files one tenant (API key) may store, batch output and error "
        "files included; an upload past it gets 429 insufficient_quota; 0: no limit.",
    )
    batch_concurrency: int = Field(
        4,
        ge=1,
        description="Lines of one batch job in flight at once (at batch priority); its other "
        "lines wait in the input file, not in memory.",
    )
    batch_retry_initial: float = Field(
        1.0,
        gt=0,
        description="Seconds before a batch line that met a temporary error (5xx: no worker, "
        "Redis away, a deadline at batch priority) runs again; doubled each time.",
    )
    batch_lease_ttl: float = Field(
        10.0,
        ge=1,
        description="Seconds a batch job's lease lasts unless its run renews it (every third "
        "of it): a job whose worker died resumes on another within this and the supervisor's "
        "round (half of it, at most 5 s); shorter resumes sooner, but a run stalled longer "
        "than it loses its job to another (which finishes it once).",
    )
    batch_retry_max: float = Field(
        60.0,
        gt=0,
        description="Longest wait between a batch line's retries; it is retried so until the "
        "batch's completion window ends.",
    )

    # Background responses (/v1/responses with background: true)
    background_timeout: int = Field(
        3600,
        ge=1,
        description="Seconds a background response may run from its creation; past it, it "
        "ends failed (its generation cancelled).",
    )
    background_retention: int = Field(
        24 * 3600,
        ge=60,
        description="Seconds a background response's events stay in Redis for a client to "
        "resume its stream (starting_after); its stored object stays LLMQ_FILE_RETENTION.",
    )

    # Webhooks (common/webhooks.py)
    webhooks: str | None = Field(
        None,
        description="Endpoints that get events of background responses and batches, a JSON "
        'list: [{"url": "https://...", "secret": "whsec_...", "events": ["batch.completed"]}] '
        "(events unset: all); signed as Standard Webhooks; unset: none.",
    )
    webhook_retry_initial: float = Field(
        5.0,
        gt=0,
        description="Seconds before a failed webhook delivery is tried again; doubled each time.",
    )
    webhook_max_attempts: int = Field(
        8,
        ge=1,
        description="Delivery attempts of one webhook event before it is given up (logged).",
    )
    webhook_timeout: float = Field(
        10.0, gt=0, description="Seconds one webhook delivery attempt waits for its receiver."
    )

    # Flower
    flower_port: int = Field(5555, ge=1, le=65535, description="Port `llmq flower` listens on.")
    flower_host: str = Field("127.0.0.1", description="Address `llmq flower` binds to.")
    flower_user: str = Field("admin", description="Flower basic-auth user.")
    flower_password: str | None = Field(
        None, description="Flower basic-auth password; unset: a random one, printed at start."
    )

    @field_validator("api_key")
    @classmethod
    def _some_key(cls, v: str | None) -> str | None:
        # A value of separators alone would turn auth off unnoticed: refuse it.
        if v and not _split_keys(v):
            raise ValueError("LLMQ_API_KEY has no key in it")
        return v

    def api_keys(self) -> list[str]:
        """The API keys clients may send (LLMQ_API_KEY split at commas); empty: no auth."""
        return _split_keys(self.api_key or "")

    @property
    def served_name(self) -> str:
        """What clients name the model in ``model``: LLMQ_SERVED_MODEL_NAME, else LLMQ_MODEL as
        given (it answers to its short id and its source as well: ``common/model_ids``)."""
        return self.served_model_name or self.model

    def redis_url_or_default(self) -> str:
        """The Redis to use: LLMQ_REDIS_URL, else the embedded one of a running `llmq up` on
        this machine, else a local Redis on its standard port."""
        return self.redis_url or embedded_redis_url() or "redis://127.0.0.1:6379/0"


def _split_keys(value: str) -> list[str]:
    return [k.strip() for k in value.split(",") if k.strip()]


@lru_cache
def get_settings() -> Settings:
    return Settings()
