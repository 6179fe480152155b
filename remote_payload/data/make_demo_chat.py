#!/usr/bin/env python3
"""Writes demo_chat.jsonl: short made-up chat conversations for trying --data (no dataset copied).

    python remote_payload/data/make_demo_chat.py > remote_payload/data/demo_chat.jsonl

Deterministic (seeded): the same file every time. Enough to exercise the pipeline (chat template, loss mask,
cache, held-out eval), far too small to train a useful drafter.
"""

from __future__ import annotations

import json
import random

FACTS = [
    ("a speculative decoding drafter", "a small model that proposes several tokens which the large model then "
     "checks in one forward pass, keeping only the prefix it agrees with"),
    ("block diffusion drafting", "filling a whole block of masked positions in one pass instead of one token at "
     "a time"),
    ("an LXC container", "a lightweight Linux environment that shares the host kernel but has its own file "
     "system, processes and network"),
    ("a checkpoint", "a saved copy of a model's weights and training state, so a run can continue after a stop"),
    ("a learning-rate warm-up", "a short phase at the start of training where the step size grows from small "
     "to its peak value"),
    ("gradient clipping", "scaling the gradient down when its norm is larger than a threshold, which keeps "
     "single bad batches from wrecking the weights"),
    ("a tokenizer", "the component that turns text into integer ids and back"),
    ("a chat template", "the rule that turns a list of messages into the exact text the model was trained on"),
    ("the acceptance length", "the average number of tokens produced per verification step of the large model"),
    ("a hidden state", "the vector a transformer layer produces for each position"),
    ("a memory map", "a file mapped into the address space, read lazily page by page instead of loaded at once"),
    ("a sha256 digest", "a 256-bit fingerprint of some bytes; a single changed bit gives a different digest"),
]
UNITS = [("kilometres", "metres", 1000), ("hours", "minutes", 60), ("kilograms", "grams", 1000),
         ("gigabytes", "megabytes", 1024), ("days", "hours", 24), ("minutes", "seconds", 60)]
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
ANIMALS = ["cat", "dog", "owl", "fox", "horse", "rabbit"]
GREETINGS = ["Hi!", "Hello there.", "Good morning!", "Hey, are you around?"]


def arithmetic(rng: random.Random) -> list[dict]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = a + b if op == "+" else a - b if op == "-" else a * b
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    return [{"role": "user", "content": f"What is {a} {op} {b}?"},
            {"role": "assistant", "content": f"{a} {word} {b} is {value}."}]


def convert(rng: random.Random) -> list[dict]:
    big, small, factor = rng.choice(UNITS)
    n = rng.randint(2, 12)
    return [{"role": "user", "content": f"How many {small} are in {n} {big}?"},
            {"role": "assistant", "content": f"One of the {big} is {factor} {small}, so {n} {big} are "
             f"{n} x {factor} = {n * factor} {small}."}]


def define(rng: random.Random) -> list[dict]:
    term, meaning = rng.choice(FACTS)
    msgs = [{"role": "user", "content": f"Can you explain what {term} is, in one sentence?"},
            {"role": "assistant", "content": f"Sure: {term} is {meaning}."}]
    if rng.random() < 0.5:
        msgs += [{"role": "user", "content": "Thanks. Can you say it even shorter?"},
                 {"role": "assistant", "content": f"In short: {meaning.split(',')[0]}."}]
    return msgs


def count(rng: random.Random) -> list[dict]:
    start, n = rng.randint(1, 50), rng.randint(4, 9)
    seq = ", ".join(str(start + i) for i in range(n))
    return [{"role": "user", "content": f"Count up from {start}, {n} numbers please."},
            {"role": "assistant", "content": f"{seq}."}]


def story(rng: random.Random) -> list[dict]:
    colour, animal = rng.choice(COLOURS), rng.choice(ANIMALS)
    return [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
            {"role": "user", "content": f"Write two sentences about a {colour} {animal}."},
            {"role": "assistant", "content": f"The {colour} {animal} lived at the edge of a quiet village. "
             f"Every evening it watched the lights come on, one window at a time."}]


def greet(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": rng.choice(GREETINGS)},
            {"role": "assistant", "content": "Hello! What can I help you with today?"},
            {"role": "user", "content": "Just checking that you work."},
            {"role": "assistant", "content": "I do. Ask me anything whenever you are ready."}]


def spell(rng: random.Random) -> list[dict]:
    word = rng.choice(["drafter", "target", "container", "checkpoint", "tokenizer", "gradient", "anchor"])
    return [{"role": "user", "content": f"Spell the word {word} backwards."},
            {"role": "assistant", "content": f"{word} backwards is {word[::-1]}."}]


def main() -> None:
    rng = random.Random(2026)
    makers = [arithmetic, convert, define, count, story, greet, spell]
    for i in range(140):
        print(json.dumps({"messages": makers[i % len(makers)](rng)}))


if __name__ == "__main__":
    main()
