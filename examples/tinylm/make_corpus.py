"""Regenerates corpus.txt: small fables composed from a seeded grammar (original text, no downloads).

The corpus only needs enough regular structure that a tiny character-level model visibly learns it on 2 CPU
cores in a few minutes. Run: python examples/tinylm/make_corpus.py > examples/tinylm/corpus.txt
"""

import random

ANIMALS = [
    "fox",
    "crow",
    "hare",
    "tortoise",
    "lion",
    "mouse",
    "wolf",
    "lamb",
    "ant",
    "grasshopper",
    "owl",
    "goat",
    "heron",
    "frog",
    "bear",
    "sparrow",
]
PLACES = [
    "by the river",
    "under the old oak",
    "at the edge of the wood",
    "in the high meadow",
    "near the mill",
    "on the hill",
    "beside the well",
    "in the farmer's field",
]
WANTS = [
    "a piece of cheese",
    "a warm place to sleep",
    "the ripest grapes",
    "a drink of cool water",
    "the praise of the others",
    "a safe road home",
    "the last grain of corn",
    "a friend for the winter",
]
ACTS = [
    "boasted of its speed",
    "laughed at the others",
    "worked through the summer",
    "waited in silence",
    "asked for help",
    "told a clever lie",
    "shared what it had",
    "slept through the morning",
]
ENDS = [
    "and lost everything it had",
    "and was thanked by all",
    "and learned to be humble",
    "and found the winter kind",
    "and was caught in its own trap",
    "and never boasted again",
    "and the others remembered it",
    "and went home with nothing",
]
MORALS = [
    "Slow and steady wins the race.",
    "Pride goes before a fall.",
    "A friend in need is a friend indeed.",
    "Look before you leap.",
    "Work today and rest tomorrow.",
    "Little by little does the trick.",
    "Kindness is never wasted.",
    "Do not count your chickens before they hatch.",
]


def fable(rng: random.Random) -> str:
    a, b = rng.sample(ANIMALS, 2)
    lines = [
        f"Once a {a} lived {rng.choice(PLACES)}.",
        f"The {a} wanted {rng.choice(WANTS)}, and so it {rng.choice(ACTS)}.",
        f"A {b} came by and saw the {a}.",
        f'"Why do you do that?" asked the {b}.',
        f"The {a} said nothing, {rng.choice(ENDS)}.",
        f"Moral: {rng.choice(MORALS)}",
    ]
    return " ".join(lines)


def main() -> None:
    rng = random.Random(1868)
    out, size = [], 0
    while size < 200_000:
        text = fable(rng)
        out.append(text)
        size += len(text) + 2
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
