"""Webhook signing and the endpoints setting: what the openai SDK verifies, and a setting
that names what llmq does not send refused."""

from __future__ import annotations

import base64
import json

import openai
import pytest

from llmq.common.settings import Settings
from llmq.common.webhooks import endpoints, new_event, signed_headers

pytestmark = pytest.mark.unit
SECRET = "whsec_" + base64.b64encode(b"a secret of the test").decode()


@pytest.mark.parametrize("secret", [SECRET, "plain secret"])
def test_the_sdk_verifies_what_is_signed(secret):
    event = new_event("batch.completed", "batch_1")
    body = json.dumps(event).encode()
    sdk = openai.OpenAI(api_key="none", webhook_secret=secret)
    unwrapped = sdk.webhooks.unwrap(body, signed_headers(secret, event["id"], body))
    assert unwrapped.type == "batch.completed" and unwrapped.data.id == "batch_1"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        sdk.webhooks.unwrap(body + b" ", signed_headers(secret, event["id"], body))


def test_endpoints_setting():
    hooks = [{"url": "http://h/1", "secret": "s", "events": ["response.failed"]}]
    [found] = endpoints(Settings(webhooks=json.dumps(hooks)))
    assert found.wants("response.failed") and not found.wants("batch.failed")
    assert endpoints(Settings()) == []
    with pytest.raises(ValueError, match="unknown event types"):
        endpoints(Settings(webhooks=json.dumps([{**hooks[0], "events": ["eval.run.failed"]}])))
    with pytest.raises(ValueError, match="not an http"):
        endpoints(Settings(webhooks=json.dumps([{"url": "file:///etc", "secret": "s"}])))
