"""A seeded generator of chat samples whose answers a program can predict from the prompt.

The demo trains a tiny target LM on this corpus and then a drafter on that target, so the corpus
is built for acceptance length: answers are long runs of tokens that follow from the prompt
(counting, times tables, copying a list in another order, spelling, regular grammar rewrites,
facts about a fixed made-up world) rather than open-ended prose a tiny model cannot learn.

Sample i of `generate(n, seed)` depends only on (seed, i), so `generate(m, seed)` is a prefix of
`generate(n, seed)` for m <= n, and the output is identical on every Python version (the stdlib
`random.Random` with a string seed is specified bit for bit).

    python -m target_server.toy_corpus --out configs/demo/chat.jsonl --n 2000 --seed 0
    python -m target_server.toy_corpus --out configs/demo/heldout.jsonl --n 64 --seed 0 \
        --start 1000000 --exclude configs/demo/chat.jsonl      # held-out rows: none is a training row
"""
from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from typing import Callable

Message = dict[str, str]
Sample = dict[str, list[Message]]

NOUNS = [
    "apple", "pear", "plum", "grape", "lemon", "melon", "cherry", "peach", "mango", "fig",
    "cat", "dog", "horse", "bird", "fox", "duck", "bear", "rabbit", "frog", "goat",
    "table", "chair", "lamp", "door", "window", "book", "pen", "cup", "bottle", "basket",
    "river", "hill", "forest", "garden", "road", "bridge", "tower", "ship", "train", "farm",
]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown", "purple", "orange", "gray"]
# Regular verbs only: "+s" for the plural rewrite's singular form, "+ed" (or "+d") for the past.
VERBS = ["walk", "jump", "paint", "clean", "open", "climb", "visit", "watch", "cook", "play",
         "push", "pull", "call", "help", "kick", "lift", "fill", "count", "mark", "wash"]
FOODS = ["honey bread", "plum cake", "fish soup", "apple pie", "cheese rolls", "pepper stew",
         "walnut cookies", "river trout", "green tea", "berry jam"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a precise assistant. Answer exactly.",
                  "Answer briefly and correctly."]


@dataclass(frozen=True)
class City:
    name: str
    country: str
    river: str
    population: int
    founded: int
    food: str


def _name(rng: random.Random, syllables: int) -> str:
    parts = ["ka", "lo", "mir", "ten", "va", "dor", "sel", "ri", "an", "bel", "tor", "ul", "nes", "pa"]
    return "".join(rng.choice(parts) for _ in range(syllables)).capitalize()


def _world() -> list[City]:
    """The fixed made-up world; independent of the sample seed so that facts agree across the corpus."""
    rng = random.Random("toy-corpus/world")
    countries = [_name(rng, 3) for _ in range(6)]
    cities: list[City] = []
    names: set[str] = set()
    while len(cities) < 40:
        name = _name(rng, rng.choice((2, 3)))
        if name in names or name in countries:
            continue
        names.add(name)
        cities.append(City(name, rng.choice(countries), _name(rng, 2), rng.randrange(20, 990) * 1000,
                           rng.randrange(900, 1900), rng.choice(FOODS)))
    return cities


WORLD = _world()


def _join(items: list[str]) -> str:
    return ", ".join(items)


def _add_s(word: str) -> str:
    """Regular plural noun / third-person verb (every word the tasks inflect is regular)."""
    return word + "es" if word.endswith(("s", "x", "ch", "sh")) else word + "s"


def _past(verb: str) -> str:
    return verb + "d" if verb.endswith("e") else verb + "ed"


# Each task returns (prompt, answer); the answer is a function of the prompt alone.
def _count(rng: random.Random) -> tuple[str, str]:
    step = rng.choice((1, 1, 1, 2, 5, 10))
    start = rng.randrange(0, 60) * step
    end = start + step * rng.randrange(5, 15)
    numbers = _join([str(x) for x in range(start, end + 1, step)])
    if step == 1:
        prompt = rng.choice(("Count from {a} to {b}.", "List the numbers from {a} to {b}.",
                             "Please count from {a} up to {b}.")).format(a=start, b=end)
    else:
        prompt = f"Count from {start} to {end} in steps of {step}."
    return prompt, numbers + "."


def _add(rng: random.Random) -> tuple[str, str]:
    terms = [rng.randrange(2, 100) for _ in range(rng.randrange(2, 5))]
    prompt = rng.choice(("Compute {e}.", "What is {e}?", "Add up {e}.")).format(e=" + ".join(map(str, terms)))
    steps, total = [], terms[0]
    for t in terms[1:]:
        steps.append(f"{total} + {t} = {total + t}.")
        total += t
    return prompt, " ".join(steps) + f" The answer is {total}."


def _times_table(rng: random.Random) -> tuple[str, str]:
    base, upto = rng.randrange(2, 13), rng.randrange(5, 11)
    prompt = rng.choice(("Write the times table of {b} from 1 to {n}.",
                         "Show the multiplication table for {b}, up to {b} x {n}.")).format(b=base, n=upto)
    return prompt, "\n".join(f"{base} x {i} = {base * i}" for i in range(1, upto + 1))


def _words(rng: random.Random, lo: int, hi: int) -> list[str]:
    return rng.sample(NOUNS + COLORS, rng.randrange(lo, hi))


def _sort(rng: random.Random) -> tuple[str, str]:
    words = _words(rng, 4, 9)
    prompt = rng.choice(("Sort these words alphabetically: {w}.", "Put these words in alphabetical order: {w}."))
    return prompt.format(w=_join(words)), _join(sorted(words)) + "."


def _reverse(rng: random.Random) -> tuple[str, str]:
    words = _words(rng, 4, 9)
    prompt = rng.choice(("Reverse this list: {w}.", "Write this list backwards: {w}."))
    return prompt.format(w=_join(words)), _join(words[::-1]) + "."


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(NOUNS + COLORS + VERBS)
    prompt = rng.choice(("Spell the word {w}.", "Spell {w} letter by letter.")).format(w=word)
    return prompt, "-".join(word.upper()) + "."


def _fact(rng: random.Random) -> tuple[str, str]:
    city = rng.choice(WORLD)
    prompt = rng.choice(("Tell me about {c}.", "What do you know about the city of {c}?",
                         "Describe {c}.")).format(c=city.name)
    return prompt, (f"{city.name} is a city in {city.country}. It lies on the river {city.river}. "
                    f"About {city.population:,} people live there. It was founded in {city.founded}. "
                    f"It is famous for its {city.food}.")


def _plural(rng: random.Random) -> tuple[str, str]:
    pairs = [(rng.choice(NOUNS[10:20]), rng.choice(VERBS)) for _ in range(rng.randrange(2, 5))]
    singular = " ".join(f"The {n} {_add_s(v)}." for n, v in pairs)
    plural = " ".join(f"The {_add_s(n)} {v}." for n, v in pairs)
    return f"Make each sentence plural: {singular}", plural


def _past_tense(rng: random.Random) -> tuple[str, str]:
    objects = [(rng.choice(VERBS), rng.choice(COLORS), rng.choice(NOUNS)) for _ in range(rng.randrange(2, 5))]
    present = " ".join(f"I {v} the {c} {n}." for v, c, n in objects)
    past = " ".join(f"I {_past(v)} the {c} {n}." for v, c, n in objects)
    return f"Rewrite in the past tense: {present}", past


def _repeat(rng: random.Random) -> tuple[str, str]:
    phrase = f"{rng.choice(COLORS)} {rng.choice(NOUNS)}"
    times = rng.randrange(3, 8)
    return f"Repeat '{phrase}' {times} times.", " ".join([phrase] * times)


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "count": _count, "add": _add, "times_table": _times_table, "sort": _sort, "reverse": _reverse,
    "spell": _spell, "fact": _fact, "plural": _plural, "past": _past_tense, "repeat": _repeat,
}

# A follow-up turn that is again a function of what came before (multi-turn loss masks get exercised).
FOLLOW_UPS: dict[str, Callable[[str], str]] = {
    "Now write your answer in capital letters.": str.upper,
    "Repeat your answer exactly.": lambda answer: answer,
}


def sample(seed: int, index: int) -> Sample:
    """Sample `index` of the corpus with `seed`: a function of (seed, index) only."""
    rng = random.Random(f"toy-corpus/{seed}/{index}")
    messages: list[Message] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    task = rng.choice(sorted(TASKS))
    prompt, answer = TASKS[task](rng)
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.1:
        follow_up = rng.choice(sorted(FOLLOW_UPS))
        messages += [{"role": "user", "content": follow_up},
                     {"role": "assistant", "content": FOLLOW_UPS[follow_up](answer)}]
    return {"messages": messages}


def generate(n: int, seed: int) -> list[Sample]:
    """n chat samples `{"messages": [{"role", "content"}, ...]}`, deterministic in (n, seed)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [sample(seed, i) for i in range(n)]


def held_out(n: int, seed: int, start: int, exclude: list[Sample]) -> list[Sample]:
    """n samples from index `start` on (indices training never reaches), skipping any sample equal
    to one in `exclude` or already taken: the corpus repeats easy prompts by chance ("Spell cat."),
    and a held-out row must never be a training row."""
    seen = {json.dumps(s, sort_keys=True) for s in exclude}
    out: list[Sample] = []
    i = start
    while len(out) < n:
        s = sample(seed, i)
        key = json.dumps(s, sort_keys=True)
        if key not in seen:  # nor twice in the held-out set itself
            seen.add(key)
            out.append(s)
        i += 1
    return out


def write_jsonl(samples: list[Sample], path: str) -> None:
    """One JSON object per line, UTF-8, written atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for s in samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output JSONL path")
    parser.add_argument("--n", type=int, default=2000, help="number of samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first sample index (held-out sets: far past training)")
    parser.add_argument("--exclude", default="", help="a JSONL file whose samples must not be repeated")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.start or args.exclude:
        exclude = []
        if args.exclude:
            with open(args.exclude, encoding="utf-8") as f:
                exclude = [json.loads(line) for line in f if line.strip()]
        samples = held_out(args.n, args.seed, args.start, exclude)
    else:
        samples = generate(args.n, args.seed)
    write_jsonl(samples, args.out)
    print(f"wrote {len(samples)} samples to {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
