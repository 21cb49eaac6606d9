"""How a request's choices are submitted: at which priority, with which ids, all or none."""

from __future__ import annotations

from dataclasses import dataclass

from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
from llmq.common.engine_client.request_stream import RequestStream
from llmq.common.errors import InvalidRequest
from llmq.common.protocol import PRIORITY_INTERACTIVE
from llmq.common.serving.choices import Choice
from llmq.common.serving.request_bodies import CompletionRequest, SamplingFields


@dataclass(frozen=True, slots=True)
class SubmitOptions:
    """``request_id_prefix`` (a batch line): the request's choices (or its one embedding
    request) get the ids ``{prefix}-0``, ``{prefix}-1``, ... in order, skip the interactive
    queue limit, and attach to requests of those ids that exist already, so that a line run a
    second time follows what its first run started instead of generating it again."""

    priority: int = PRIORITY_INTERACTIVE
    request_id_prefix: str | None = None

    def request_id(self, k: int) -> str | None:
        """The id of the request's k-th choice (None: a fresh one)."""
        return None if self.request_id_prefix is None else f"{self.request_id_prefix}-{k}"

    @property
    def attach(self) -> bool:
        return self.request_id_prefix is not None


async def submit_all(
    pipeline: TokenGeneratorPipeline,
    choices: list[Choice],
    body: SamplingFields,
    options: SubmitOptions,
) -> list[RequestStream]:
    """Every choice, or none: the queue admits the request as a whole at its first choice,
    counting every prompt x n (a 429 after work was done would have a retrying client do it
    all again); one larger than the whole queue is a 400, since no retry could fit it."""
    if not options.attach and len(choices) > pipeline.max_queue:
        raise InvalidRequest(
            f"this request asks for {len(choices)} generations (prompts x n) and the queue "
            f"holds at most {pipeline.max_queue}; send fewer prompts or a smaller n",
            "prompt" if isinstance(body, CompletionRequest) else "n",
            "request_too_large",
        )
    streams: list[RequestStream] = []
    try:
        for k, c in enumerate(choices):
            streams.append(
                await pipeline.submit(
                    c.prompt_ids,
                    c.params,
                    stop=body.stop_list(),
                    include_stop=body.include_stop_str_in_output,
                    queue_slots=0 if streams else len(choices),
                    request_id=options.request_id(k),
                    priority=options.priority,
                    attach=options.attach,
                    images=c.images,
                )
            )
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return streams
