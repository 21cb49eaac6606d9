"""Evaluation harnesses against llmq, through real processes: vLLM's tokenizer endpoints
(/tokenize, /detokenize, /tokenizer_info) and lm-evaluation-harness scoring a local
multiple-choice task through llmq (`local-completions`: echo with logprobs over token ids)
with the same per-document loglikelihoods and accuracy as its own `hf` model on the same
float32 folder."""

from __future__ import annotations

import json

import httpx
import pytest

from llmq.common.model_files import load_tokenizer
from tests.api.api_stack import MESSAGES, PROMPT, assert_error

TOL = 1e-4
TASK = "llmq_tiny_mc"
GEN_TASK = "llmq_tiny_gen"
DOCS = [
    ("The capital of France is", ["Paris", "Berlin", "a river", "seven"], 0),
    ("import numpy as", ["np", "pd", "torch", "os"], 0),
    ("def fibonacci(n):\n    if n <", ["2:", "0.5", "'a'", "None"], 0),
    ("Redis streams are read with", ["XREADGROUP", "SELECT", "GET", "ls"], 0),
    ("for i in range(", ["10):", "x]", "'", "}"], 0),
    ("The opposite of hot is", ["cold", "warm", "blue", "fast"], 0),
]


@pytest.fixture(scope="module")
def served(main):
    """The package's shared stack of the test model."""
    return main


def test_tokenize_detokenize_and_tokenizer_info(served, llama_dir):
    tok = load_tokenizer(str(llama_dir))
    base = served.base
    r = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == tok.encode(PROMPT) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == int(served.heartbeat()["max_model_len"])
    back = httpx.post(f"{base}/detokenize", json={"tokens": out["tokens"]}, timeout=60).json()
    assert back == {"prompt": PROMPT}
    body = {"model": served.model, "messages": MESSAGES, "add_generation_prompt": True}
    chat = httpx.post(f"{base}/tokenize", json=body, timeout=60).json()
    want = tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chat["tokens"] == list(want)
    body = {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True}
    strs = httpx.post(f"{base}/tokenize", json=body, timeout=60).json()["token_strs"]
    assert strs == tok.convert_ids_to_tokens(tok.encode(PROMPT, add_special_tokens=False))
    info = httpx.get(f"{base}/tokenizer_info", timeout=60).json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == out["max_model_len"]
    # Errors as the other routes answer them.
    assert_error(httpx.post(f"{base}/tokenize", json={}), 400)
    both = {"prompt": "x", "messages": MESSAGES}
    assert_error(httpx.post(f"{base}/tokenize", json=both), 400)
    bad = {"messages": [{"role": "user", "content": None}]}
    assert_error(httpx.post(f"{base}/tokenize", json=bad), 400, param="messages.0.content")
    vocab = len(tok)
    body = {"tokens": [1, 10**6 + vocab]}
    assert_error(httpx.post(f"{base}/detokenize", json=body), 400, param="tokens")
    assert_error(httpx.post(f"{base}/detokenize", json={"tokens": [-1]}), 400, param="tokens.0")
    body = {"model": "nope", "prompt": "x"}
    assert_error(httpx.post(f"{base}/tokenize", json=body), 404, param="model")
    assert_error(httpx.get(f"{base}/tokenizer_info", params={"model": "nope"}), 404)
    # lm-eval's remote tokenizer (its default where the server has these endpoints).
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(f"{base}/v1/completions")
    remote = RemoteTokenizer(f"{base}/v1/completions")
    ids = tok.encode(PROMPT, add_special_tokens=False)
    assert remote.encode(PROMPT) == ids and remote.decode(ids) == tok.decode(ids)
    assert remote.eos_token_id == tok.eos_token_id


def write_tasks(folder) -> None:
    """The multiple-choice task, and a generation task over the same questions."""
    data = folder / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"q": q, "choices": c, "label": a}) + "\n" for q, c, a in DOCS)
    )
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        'test_split: test\ndoc_to_text: "{{q}}"\n'
    )
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n{common}output_type: multiple_choice\n"
        'doc_to_target: label\ndoc_to_choice: choices\ntarget_delimiter: " "\n'
        "metric_list:\n  - metric: acc\n"
    )
    (folder / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n{common}output_type: generate_until\n"
        'doc_to_target: "{{choices[label]}}"\n'
        "generation_kwargs:\n  until: []\n  max_gen_toks: 6\n  do_sample: false\n"
        "  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def evaluate(model: str, model_args: dict, tasks_dir, task: str = TASK, **options) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        # The two tasks of tasks_dir alone: indexing lm-eval's thousands of built-in tasks
        # took 4-5 s a call.
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        **options,
        batch_size=4,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def loglikelihoods(results: dict) -> dict[int, list[float]]:
    """Per document, each choice's loglikelihood."""
    return {
        s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in results["samples"][TASK]
    }


def test_lm_eval_scores_through_llmq_as_on_the_model(served, llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    write_tasks(tmp_path)
    through_llmq = evaluate(
        "local-completions",
        {
            "base_url": f"{served.base}/v1/completions",
            "model": served.model,
            "tokenizer_backend": "huggingface",
            "tokenizer": str(llama_dir),
            "tokenized_requests": True,
            "num_concurrent": 2,
            "max_retries": 1,
        },
        tmp_path,
    )
    direct = evaluate(
        "hf", {"pretrained": str(llama_dir), "dtype": "float32", "device": "cpu"}, tmp_path
    )
    ours, theirs = loglikelihoods(through_llmq), loglikelihoods(direct)
    assert ours.keys() == theirs.keys() == set(range(len(DOCS)))
    for doc, lls in ours.items():
        assert len(lls) == 4
        assert max(abs(a - b) for a, b in zip(lls, theirs[doc], strict=True)) < TOL, doc
    acc = through_llmq["results"][TASK]["acc,none"]
    assert acc == direct["results"][TASK]["acc,none"]


def test_lm_eval_generates_through_llmq_chat_as_the_engine_does(
    served, llama_dir, tmp_path, monkeypatch
):
    """A generate_until task through `local-chat-completions`: each answer is the greedy
    continuation of the chat-templated question, as the in-process engine generates it."""
    from llmq.common.sampling_params import SamplingParams
    from llmq.worker.llm_engine import EngineConfig, LLMEngine
    from llmq.worker.loading.model_loader import eos_token_ids, load_causal_lm

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    write_tasks(tmp_path)
    args = {
        "base_url": f"{served.base}/v1/chat/completions",
        "model": served.model,
        "tokenizer_backend": "none",
        "num_concurrent": 2,
        "max_retries": 1,
    }
    out = evaluate("local-chat-completions", args, tmp_path, GEN_TASK, apply_chat_template=True)
    answers = {s["doc_id"]: s["resps"][0][0] for s in out["samples"][GEN_TASK]}
    tok = load_tokenizer(str(llama_dir))
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    engine = LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids(model, tok))
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for q, _, _ in DOCS
    ]
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    assert answers == {i: tok.decode(t, skip_special_tokens=True) for i, t in enumerate(greedy)}
    assert sum(map(bool, answers.values())) >= len(DOCS) // 2  # text, not empty answers
