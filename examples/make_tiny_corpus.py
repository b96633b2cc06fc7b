"""Write a small tokenized corpus in Megatron's indexed-dataset format (``PREFIX.bin`` +
``PREFIX.idx``) for the CPU examples: no download, deterministic, a few seconds.

    python examples/make_tiny_corpus.py --output data/tiny_corpus/tiny [--documents 20000] [--seed 0]

The text is a toy language with learnable structure: short stories built from templates (names,
objects, colours, places, who gives what to whom) and arithmetic facts ("7 plus 5 is 12."), so the
loss of a tiny model falls well below the uniform ``ln(256) = 5.55`` within a few hundred steps.
Tokens are bytes (ASCII text) and the end-of-document token is 255, i.e. Megatron's
``--tokenizer-type NullTokenizer --vocab-size 256`` (whose EOD id is ``vocab_size - 1``).
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np

VOCAB_SIZE = 256
EOD = VOCAB_SIZE - 1

NAMES = ["Mia", "Sam", "Ada", "Leo", "Zoe", "Max", "Ivy", "Tom", "Eva", "Ben", "Lia", "Kai"]
OBJECTS = ["ball", "book", "kite", "cup", "hat", "box", "drum", "boat", "lamp", "coin"]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "pink", "brown"]
PLACES = ["park", "garden", "school", "beach", "forest", "market", "river", "house"]
FEELINGS = ["happy", "sad", "tired", "glad", "proud", "calm"]


def story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    obj, colour, place, feeling = rng.choice(OBJECTS), rng.choice(COLOURS), rng.choice(PLACES), rng.choice(FEELINGS)
    lines = [
        f"{a} has a {colour} {obj}.",
        f"{a} goes to the {place} with the {obj}.",
        f"At the {place}, {a} meets {b}.",
    ]
    if rng.random() < 0.5:
        lines += [f"{a} gives the {colour} {obj} to {b}.", f"Now {b} has the {colour} {obj}.", f"{b} is {feeling}."]
    else:
        lines += [f"{b} asks for the {obj}.", f"{a} keeps the {colour} {obj}.", f"{b} is not {feeling}."]
    return " ".join(lines)


def arithmetic(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(3, 6)):
        x, y = rng.randint(0, 20), rng.randint(0, 20)
        if rng.random() < 0.5:
            facts.append(f"{x} plus {y} is {x + y}.")
        else:
            x, y = max(x, y), min(x, y)
            facts.append(f"{x} minus {y} is {x - y}.")
    return " ".join(facts)


def documents(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        yield story(rng) if rng.random() < 0.7 else arithmetic(rng)


def write_corpus(prefix: str, n_documents: int = 20000, seed: int = 0) -> tuple[int, int]:
    """Write ``prefix.bin``/``prefix.idx``; returns (documents, tokens incl. EOD)."""
    from minite_megatron.training import upstream_warnings

    upstream_warnings.install()  # megatron-core's import-time notes about apex / TE, named there
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    tokens = 0
    for text in documents(n_documents, seed):
        ids = np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.uint16)
        doc = np.concatenate([ids, np.array([EOD], dtype=np.uint16)])
        builder.add_document(doc, [len(doc)])
        tokens += len(doc)
    builder.finalize(prefix + ".idx")
    return n_documents, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="data/tiny_corpus/tiny", help="path prefix of the .bin/.idx pair")
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n, tokens = write_corpus(args.output, args.documents, args.seed)
    print(f"wrote {args.output}.bin/.idx: {n} documents, {tokens} tokens (vocab {VOCAB_SIZE}, EOD {EOD})")


if __name__ == "__main__":
    main()
