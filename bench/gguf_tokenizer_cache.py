"""A GGUF file's tokenizer at a start: converted from the file's metadata (the first start)
against read from llmq's cache (every later one), side by side in one process.

    python bench/gguf_tokenizer_cache.py FILE.gguf [FILE.gguf ...]

Each file: the conversion into an empty cache, then the read from it, then the read again;
the seconds of each, and whether the cached tokenizer encodes a few texts as the converted one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main(paths: list[str]) -> None:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["LLMQ_TOKENIZER_CACHE_DIR"] = cache
        from llmq.common.gguf_tokenizer import load_gguf_tokenizer

        for path in paths:
            times, tokenizers = [], []
            for _ in range(3):
                started = time.monotonic()
                tokenizers.append(load_gguf_tokenizer(path))
                times.append(time.monotonic() - started)
            texts = ["What is the capital of France?", "def f(x):\n    return x ** 2  # ünï 日本"]
            same = all(t.encode(s) == tokenizers[0].encode(s) for t in tokenizers for s in texts)
            print(
                f"{os.path.basename(path)}: converted {times[0]:.2f} s, from the cache "
                f"{times[1]:.2f} / {times[2]:.2f} s ({times[0] / min(times[1:]):.1f}x), "
                f"same encodings: {same}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", metavar="FILE.gguf")
    main(parser.parse_args().files)
