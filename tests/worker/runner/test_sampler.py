"""The sampler: greedy and top_k=1, seeded reproducibility inside any batch, the distributions
that temperature, top_k, top_p and min_p give, penalties and min_tokens
(logprobs: test_sampler_logprobs.py).

Statistical checks draw many rows of one hand-made logits row in a single call with a fixed
torch seed and compare empirical frequencies with the exact target distribution."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.sequence import Sequence
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner.sampler import Sampler, _top_k_top_p

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

EOS = 2


def seq_with(params: SamplingParams, prompt=(1,), output=()) -> Sequence:
    return Sequence("r", list(prompt), params, output_token_ids=list(output))


def draw(row: list[float], params: SamplingParams, n: int = 20_000, seed: int = 0) -> torch.Tensor:
    """Empirical frequencies of n draws from one logits row."""
    logits = torch.tensor(row, dtype=torch.float32).expand(n, len(row)).clone()
    seqs = [seq_with(params) for _ in range(n)]
    torch.manual_seed(seed)
    out = Sampler()(logits, seqs)
    assert len(out.token_ids) == n
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(row)).double() / n


def close(freqs: torch.Tensor, probs, tol: float = 0.02) -> None:
    probs = torch.as_tensor(probs, dtype=torch.float64)
    assert torch.allclose(freqs, probs, atol=tol), (freqs.tolist(), probs.tolist())


ROW = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
QUARTER = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]


# ---- distributions ----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature):
    freqs = draw(ROW, SamplingParams(temperature=temperature))
    expected = torch.softmax(torch.tensor(ROW, dtype=torch.float64) / temperature, dim=0)
    close(freqs, expected)


def test_temperature_orders_sharpness():
    sharp = draw(ROW, SamplingParams(temperature=0.5))
    flat = draw(ROW, SamplingParams(temperature=2.0))
    assert sharp[0] > 0.8 > 0.5 > flat[0]
    assert flat[5] > 0.02 > 0.002 > sharp[5]  # exact: 0.0298 and 0.0002


def test_top_p_keeps_the_nucleus_only():
    freqs = draw(QUARTER, SamplingParams(top_p=0.5))
    # 0.4 < 0.5: the second token is needed to reach 0.5; the others never appear.
    assert freqs[2] == 0 and freqs[3] == 0
    close(freqs, [0.4 / 0.7, 0.3 / 0.7, 0, 0])
    freqs = draw(QUARTER, SamplingParams(top_p=0.75))
    assert freqs[3] == 0
    close(freqs, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0])
    # top_p 0.3: the most likely token alone.
    assert draw(QUARTER, SamplingParams(top_p=0.3), n=2000).tolist() == [1, 0, 0, 0]


def test_top_k_keeps_k_tokens():
    freqs = draw(QUARTER, SamplingParams(top_k=2))
    assert freqs[2] == 0 and freqs[3] == 0
    close(freqs, [0.4 / 0.7, 0.3 / 0.7, 0, 0])
    freqs = draw(QUARTER, SamplingParams(top_k=3, top_p=0.95))
    close(freqs, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0])


def test_unfiltered_row_is_not_filtered_because_of_its_neighbour():
    """A request with top_k=0 and top_p=1.0 samples from its whole distribution, whatever shares
    its batch. When another row asks for top_k or top_p, ``_top_k_top_p`` runs on every row,
    and for a row with top_p=1.0 the float32 cumulative sum reaches 1.0 before the tail:
    ``before >= 1.0`` then drops the tail tokens (here 20102 of 49152 tokens, 1e-5 of the
    mass), so that row's distribution, and a seeded request's tokens, depend on the batch."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 49152, generator=gen) * 4
    for top_k, top_p in (([0, 50], [1.0, 1.0]), ([0, 0], [1.0, 0.9])):
        out = _top_k_top_p(logits, top_k, top_p)
        dropped = int(torch.isinf(out[0]).sum())
        assert dropped == 0, f"{dropped} tokens of an unfiltered row were masked"
        assert torch.equal(out[0], logits[0])


def test_min_p_masks_low_tokens():
    row = [math.log(p) for p in (0.5, 0.2, 0.16, 0.14)]
    freqs = draw(row, SamplingParams(min_p=0.3))  # threshold 0.3 * 0.5 = 0.15
    assert freqs[3] == 0
    close(freqs, [0.5 / 0.86, 0.2 / 0.86, 0.16 / 0.86, 0])
    assert (draw(row, SamplingParams(min_p=0.0))[3] - 0.14).abs() < 0.02


def test_unseeded_rows_differ_seeded_rows_repeat():
    logits = torch.zeros(64, 50)
    unseeded = [seq_with(SamplingParams(temperature=1.0)) for _ in range(64)]
    assert len(set(Sampler()(logits, unseeded).token_ids)) > 20
    seeded = [seq_with(SamplingParams(temperature=1.0, seed=7)) for _ in range(64)]
    assert len(set(Sampler()(logits, seeded).token_ids)) == 1
    # The seed's noise depends on how many tokens the request generated so far.
    later = [seq_with(SamplingParams(temperature=1.0, seed=7), output=[3] * k) for k in range(64)]
    assert len(set(Sampler()(logits, later).token_ids)) > 20


# ---- greedy -------------------------------------------------------------------------------------


def test_top_k_1_is_greedy_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 300, generator=gen) * 3
    variants = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1e-40),  # below 1e-5: greedy (dividing by it overflows)
        SamplingParams(temperature=9.9e-6, seed=11),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.5, top_k=1, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.7, top_k=1, seed=3),
    ]
    expected = logits.argmax(dim=-1).tolist()
    for params in variants:
        seqs = [seq_with(params) for _ in range(32)]
        assert Sampler()(logits, seqs).token_ids == expected
    # Mixed with random rows in one batch, greedy rows still take the argmax.
    seqs = [
        seq_with(variants[i % 2] if i % 3 else SamplingParams(temperature=1.0)) for i in range(32)
    ]
    got = Sampler()(logits, seqs).token_ids
    for i in range(32):
        if i % 3:
            assert got[i] == expected[i]


def test_top_k_1_equals_greedy_through_engine(llama_dir):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    engine = LLMEngine(
        load_causal_lm(str(llama_dir), "float32", "cpu"),
        EngineConfig(num_blocks=128),
        eos_token_ids={EOS},
    )
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    top1 = engine.generate(
        prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True)
    )
    assert top1 == greedy
    sampled = engine.generate(
        prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    )
    assert sampled != greedy  # the model's distribution is not so peaked that sampling is greedy


# ---- seeded requests through the engine ----------------------------------------------------


def run_engine(llama_dir, config: EngineConfig, requests, add_at=None):
    """requests: list of (request_id, prompt, params[, output_token_ids]); add_at: request_id ->
    step before which it is added (default 0). Returns request_id -> generated tokens."""
    engine = LLMEngine(load_causal_lm(str(llama_dir), "float32", "cpu"), config, {EOS})
    add_at = add_at or {}
    pending = list(requests)
    results: dict[str, list[int]] = {r[0]: [] for r in requests}
    step = 0
    while pending or engine.has_unfinished():
        for r in [r for r in pending if add_at.get(r[0], 0) <= step]:
            pending.remove(r)
            engine.add_request(r[0], r[1], r[2], output_token_ids=r[3] if len(r) > 3 else None)
        for out in engine.step():
            results[out.request_id].extend(out.token_ids)
        step += 1
        assert step < 2000
    return results, engine


SEEDED_PROMPT = [17, 300, 45, 999, 12, 512, 77, 600, 31, 8]


def seeded_params(seed=1234) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)


def crowd(n: int = 12) -> tuple[list, dict]:
    rng = random.Random(99)
    requests, add_at = [], {}
    for i in range(n):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 120))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
            top_p=rng.choice([1.0, 0.9, 0.5]),
            top_k=rng.choice([0, 0, 5, 50]),
            min_p=rng.choice([0.0, 0.1]),
            presence_penalty=rng.choice([0.0, 0.5]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            seed=rng.choice([None, None, rng.randrange(1000)]),
            max_tokens=rng.randint(4, 30),
            ignore_eos=True,
        )
        requests.append((f"c{i}", prompt, params))
        add_at[f"c{i}"] = rng.randint(0, 8)
    return requests, add_at


def test_seeded_request_same_alone_and_in_batch(llama_dir):
    alone, _ = run_engine(
        llama_dir, EngineConfig(num_blocks=64), [("s", SEEDED_PROMPT, seeded_params())]
    )
    tokens = alone["s"]
    assert len(tokens) == 16 and len(set(tokens)) > 8
    again, _ = run_engine(
        llama_dir, EngineConfig(num_blocks=64), [("s", SEEDED_PROMPT, seeded_params())]
    )
    assert again["s"] == tokens
    other, _ = run_engine(
        llama_dir, EngineConfig(num_blocks=64), [("s", SEEDED_PROMPT, seeded_params(seed=4321))]
    )
    assert other["s"] != tokens

    requests, add_at = crowd()
    requests.append(("s", SEEDED_PROMPT, seeded_params()))
    add_at["s"] = 3
    # A full batch in an ample pool, then one so small that requests are preempted.
    batched, _ = run_engine(llama_dir, EngineConfig(num_blocks=256), requests, add_at)
    assert batched["s"] == tokens
    small, engine = run_engine(
        llama_dir, EngineConfig(num_blocks=14, max_batch_tokens=48), requests, add_at
    )
    assert engine.scheduler.num_preemptions > 0
    assert small["s"] == tokens
    # Every other seeded request agrees between the two runs as well.
    for rid, _, params in requests:
        if params.seed is not None or params.greedy:
            assert small[rid] == batched[rid], rid


def test_seeded_request_resumes_with_the_same_tokens(llama_dir):
    full, _ = run_engine(
        llama_dir, EngineConfig(num_blocks=64), [("s", SEEDED_PROMPT, seeded_params())]
    )
    tokens = full["s"]
    # A request resumed elsewhere after 6 tokens continues with the same draws.
    resumed, _ = run_engine(
        llama_dir,
        EngineConfig(num_blocks=64),
        [("s", SEEDED_PROMPT, seeded_params(), tokens[:6])],
    )
    assert resumed["s"] == tokens[6:]


# ---- penalties and min_tokens -------------------------------------------------------------------


def pick(row: list[float], params: SamplingParams, prompt=(1,), output=()) -> int:
    logits = torch.tensor([row], dtype=torch.float32)
    before = logits.clone()
    token = Sampler(eos_token_ids={EOS})(logits, [seq_with(params, prompt, output)]).token_ids[0]
    assert torch.equal(logits, before), "the sampler changed the caller's logits"
    return token


def test_penalties_lower_repeated_tokens():
    row = [0.0] * 10
    row[5], row[6] = 2.0, 1.9
    g = dict(temperature=0)
    assert pick(row, SamplingParams(**g), output=[5]) == 5
    # repetition: 2.0 / 1.2 = 1.67 < 1.9, over prompt and output tokens
    assert pick(row, SamplingParams(**g, repetition_penalty=1.2), output=[5]) == 6
    assert pick(row, SamplingParams(**g, repetition_penalty=1.2), prompt=[5]) == 6
    # presence: 2.0 - 0.2 = 1.8 < 1.9, output tokens only
    assert pick(row, SamplingParams(**g, presence_penalty=0.2), output=[5]) == 6
    assert pick(row, SamplingParams(**g, presence_penalty=0.2), prompt=[5]) == 5
    # frequency scales with the count: 2.0 - 0.06 > 1.9 but 2.0 - 3 * 0.06 < 1.9
    assert pick(row, SamplingParams(**g, frequency_penalty=0.06), output=[5]) == 5
    assert pick(row, SamplingParams(**g, frequency_penalty=0.06), output=[5, 5, 5]) == 6
    assert pick(row, SamplingParams(**g, frequency_penalty=0.06), prompt=[5, 5, 5]) == 5
    # a negative logit is multiplied by the repetition penalty: lowered, not raised
    neg = [-1.5] * 10
    neg[5] = -1.0
    assert pick(neg, SamplingParams(**g), prompt=[5]) == 5
    assert pick(neg, SamplingParams(**g, repetition_penalty=2.0), prompt=[5]) != 5


def test_penalty_shifts_sampled_distribution():
    n = 8_000
    logits = torch.zeros(n, 2)
    params = SamplingParams(temperature=1.0, presence_penalty=math.log(3))
    seqs = [seq_with(params, output=[0]) for _ in range(n)]
    torch.manual_seed(0)
    got = torch.tensor(Sampler()(logits, seqs).token_ids)
    # token 0 repeated: its weight drops from 1 to 1/3, so P(0) = 0.25
    assert abs(float((got == 0).double().mean()) - 0.25) < 0.02


def test_logit_bias_forces_bans_and_shifts():
    row = [0.0] * 10
    row[5] = 3.0
    g = dict(temperature=0)
    assert pick(row, SamplingParams(**g)) == 5
    assert pick(row, SamplingParams(**g, logit_bias={8: 100.0})) == 8
    assert pick(row, SamplingParams(**g, logit_bias={5: -100.0, 2: 0.5})) == 2
    # sampled: a bias of log 3 on one of two equal tokens gives it 3/4 of the draws
    freqs = draw([0.0, 0.0], SamplingParams(temperature=1.0, logit_bias={1: math.log(3)}))
    close(freqs, [0.25, 0.75])
    # the wire format's string keys come back as ids
    params = SamplingParams(logit_bias={7: 1.5})
    wire = json.loads(json.dumps(params.to_dict()))
    assert SamplingParams.from_dict(wire).logit_bias == {7: 1.5}


def test_min_tokens_bans_eos_and_stop_tokens():
    row = [0.0] * 10
    row[EOS], row[7], row[4] = 3.0, 2.5, 2.0
    g = dict(temperature=0, stop_token_ids=[7])
    assert pick(row, SamplingParams(**g, min_tokens=2), output=[4]) == 4
    assert pick(row, SamplingParams(**g, min_tokens=2), output=[4, 4]) == EOS
    # ignore_eos: eos does not stop, so it is not banned either; the stop token still is
    assert pick(row, SamplingParams(**g, min_tokens=2, ignore_eos=True), output=[4]) == EOS
    row[EOS] = 0.0
    assert pick(row, SamplingParams(**g, min_tokens=2, ignore_eos=True), output=[4]) == 4
    assert pick(row, SamplingParams(**g, min_tokens=2, ignore_eos=True), output=[4, 4]) == 7
    assert pick(row, SamplingParams(**g), output=[]) == 7  # no min_tokens: nothing banned
