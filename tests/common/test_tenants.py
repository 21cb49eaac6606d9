"""API keys as tenants: LLMQ_API_KEY's list of keys, and the owner ids stored in their place."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from llmq.common.settings import Settings
from llmq.common.tenants import ANONYMOUS, owner_id

pytestmark = pytest.mark.unit


def test_api_key_takes_one_key_or_several_separated_by_commas():
    assert Settings(api_key=None).api_keys() == []
    assert Settings(api_key="").api_keys() == []
    assert Settings(api_key="one").api_keys() == ["one"]
    assert Settings(api_key=" a ,, b ,\tc,").api_keys() == ["a", "b", "c"]


@pytest.mark.parametrize("value", [",", " , ,", " "])
def test_an_api_key_of_separators_alone_is_refused_not_read_as_no_auth(value):
    with pytest.raises(ValidationError, match="no key in it"):
        Settings(api_key=value)


def test_owner_ids_are_short_hashes_of_the_keys_never_the_keys():
    a, b = owner_id("key-a"), owner_id("key-b")
    assert a == hashlib.sha256(b"key-a").hexdigest()[:16] and len(a) == 16
    assert a != b and "key" not in a and ANONYMOUS not in (a, b)
