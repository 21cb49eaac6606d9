"""What constrained decoding costs the engine per step, measured in process on the served
tokenizer: building a grammar's matcher (once per grammar text per worker), copying it for a
sequence, filling the token bitmask for every constrained row, adding it to the logits, and the
greedy sampler with the mask against without it, at 1 to 64 constrained rows.

    .venv/bin/llmq make-model bench/out/models/smollm2-135m --arch llama --size smollm2-135m
    .venv/bin/python bench/grammar_mask.py [--model-dir DIR] [--threads 2]

Not a test: figures depend on the machine; the ratios (sampler with/without the mask) are what
travels. Medians of --repeat runs.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A mid-size schema: nested object, arrays with bounds, enums, integer bounds, a pattern.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["a", "b", "c"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "DE", "FR"]},
            },
            "required": ["street", "zip", "country"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["id", "qty"],
                "additionalProperties": False,
            },
            "maxItems": 5,
        },
    },
    "required": ["name", "age", "tags", "address", "active", "items"],
    "additionalProperties": False,
}


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(ROOT / "bench/out/models/smollm2-135m"))
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--rows", default="1,8,32,64", help="constrained rows per step")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    from llguidance import LLMatcher

    from llmq.common.model_files import load_tokenizer
    from llmq.common.sampling_params import SamplingParams
    from llmq.worker.constrained_sequences import ConstrainedSequences
    from llmq.worker.engine.sequence import Sequence
    from llmq.worker.grammar_compiler import GrammarCompiler
    from llmq.worker.runner.sampler import Sampler
    from llmq.worker.runner.token_mask import apply_token_mask

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model_dir)
    vocab = len(tokenizer)
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    template = compiler.template(grammar).result()
    print(f"vocabulary {vocab}, torch threads {args.threads}")
    print(f"LLTokenizer + first grammar: {(time.perf_counter() - start) * 1e3:.0f} ms (once)")
    build = median_ms(lambda: compiler._build(grammar), max(5, args.repeat // 10))
    copy = median_ms(template.deep_copy, args.repeat)
    print(f"grammar build {build:.2f} ms (once per grammar), a sequence's copy {copy:.3f} ms")
    inside_string = tokenizer.encode('{"name": "', add_special_tokens=False)
    sampler = Sampler({tokenizer.eos_token_id})
    print("rows | fill ms | apply ms | greedy sampler ms: plain -> masked | per row")
    for rows in (int(r) for r in args.rows.split(",")):
        constrained = ConstrainedSequences(compiler, max(rows, 64))
        seqs = []
        for i in range(rows):
            seq = Sequence(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0, grammar=grammar))
            matcher = template.deep_copy()
            matcher.consume_tokens(inside_string)  # inside a string: most tokens allowed
            constrained.matchers[seq.request_id] = matcher
            seqs.append(seq)
        logits = torch.randn(rows, vocab)
        fill = median_ms(lambda: constrained.mask(seqs), args.repeat)  # noqa: B023
        mask = constrained.mask(seqs)
        clone = median_ms(logits.clone, args.repeat)
        apply = median_ms(lambda: apply_token_mask(logits.clone(), mask), args.repeat) - clone  # noqa: B023
        plain = median_ms(lambda: sampler(logits, seqs), args.repeat)  # noqa: B023
        masked = median_ms(lambda: sampler(logits, seqs, mask), args.repeat)  # noqa: B023
        per_row = (fill + apply) / rows
        print(
            f"{rows:4d} | {fill:7.3f} | {apply:8.3f} | {plain:.3f} -> {masked:.3f} | {per_row:.3f}"
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MiB")
    compiler.close()


if __name__ == "__main__":
    main()
