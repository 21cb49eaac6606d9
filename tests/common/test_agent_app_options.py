"""Options the agent apps (and vLLM's clients) send to chat and completions: vLLM's
``return_tokens_as_token_ids`` on completions' logprobs, the vLLM options llmq does not
implement refused unless they ask for what it does anyway, and `llmq make-model --context`."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.logprobs import completion_logprobs, echo_logprobs
from llmq.common.serving.request_bodies import UNSERVED_DEFAULTS, CompletionRequest

pytestmark = pytest.mark.unit
BODIES = [
    (CompletionRequest, {"prompt": "x"}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
]


class Bytes:
    """A tokenizer whose token i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_completion_logprobs_name_tokens_by_id_and_keep_the_texts_offsets():
    entries = [{"token_id": 104, "logprob": -0.5, "top": [[104, -0.5], [105, -1.0]]}]
    entries.append({"token_id": 105, "logprob": -0.25, "top": []})
    named, end = completion_logprobs(Bytes(), entries, 3, as_ids=True)
    assert named.tokens == ["token_id:104", "token_id:105"]
    assert named.top_logprobs[0] == {"token_id:104": -0.5, "token_id:105": -1.0}
    assert named.text_offset == [3, 4] and end == 5  # offsets count the tokens' text
    plain, _ = completion_logprobs(Bytes(), entries, 3)
    assert plain.tokens == ["h", "i"] and plain.text_offset == named.text_offset
    echoed = echo_logprobs(Bytes(), [104, 105], [None, entries[1]], 1, as_ids=True)
    assert echoed.tokens == ["token_id:104", "token_id:105"] and echoed.top_logprobs[0] is None
    assert CompletionRequest.model_validate(
        {"prompt": "x", "return_tokens_as_token_ids": True}
    ).return_tokens_as_token_ids


@pytest.mark.parametrize("model, base", BODIES)
@pytest.mark.parametrize("name", sorted(UNSERVED_DEFAULTS))
def test_unimplemented_options_are_refused_unless_they_ask_for_the_default(model, base, name):
    for value in UNSERVED_DEFAULTS[name] + (None,):
        model.model_validate({**base, name: value})  # what llmq does anyway: accepted
    with pytest.raises(ValidationError, match=f"{name} is not supported by this server"):
        model.model_validate({**base, name: "something else"})


def test_make_model_takes_a_context_length():
    from llmq.tools import make_model_cli

    parser = argparse.ArgumentParser()
    make_model_cli.register(parser.add_subparsers())
    args = parser.parse_args(["make-model", "out", "--context", "131072"])
    assert args.context == 131072 and args.size == "tiny"
    assert parser.parse_args(["make-model", "out"]).context is None
