"""A small labelled text set for fine-tuning a BERT checkpoint on sequence classification: short
sentences about four topics (weather, sports, cooking, technology), templated and seeded. The
repository carries one draw of it in ``data/topics/`` (what the MiniLM fine-tune reads):

    python -m fusec.train.topics -o data/topics [--train 480] [--heldout 160] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

from fusec.train.atis_like import write_splits

OPENERS = ["", "i heard that", "my friend said", "according to the news,", "honestly,", "yesterday", "this morning",
           "it seems", "everyone agrees", "apparently"]
TOPICS = {
    "weather": {
        "subject": ["the forecast", "the storm", "the rain", "the wind", "the heat wave", "the snow", "the fog",
                    "the humidity", "the temperature", "a cold front"],
        "verb": ["will reach", "is moving toward", "should clear out of", "hit", "is expected in", "covered",
                 "made it miserable in", "is lingering over"],
        "object": ["the coast", "the valley", "the city", "the mountains", "our town", "the northern region",
                   "the airport", "the weekend"],
        "tail": ["tonight", "by tomorrow", "with strong gusts", "so bring an umbrella", "after a sunny morning",
                 "with freezing temperatures", ""],
    },
    "sports": {
        "subject": ["the striker", "the home team", "our goalkeeper", "the coach", "the rookie", "the champions",
                    "the referee", "the visiting side", "the point guard", "the pitcher"],
        "verb": ["scored against", "defeated", "lost to", "trained with", "was traded to", "celebrated with",
                 "beat", "tied with"],
        "object": ["the rival club", "the league leaders", "the defending champions", "the crowd", "the national team",
                   "their opponents", "the underdogs", "the fans"],
        "tail": ["in overtime", "in the final minute", "after a penalty", "during the playoffs", "at the stadium",
                 "for the title", ""],
    },
    "cooking": {
        "subject": ["the chef", "my grandmother", "the baker", "the recipe", "the soup", "the sauce", "the dough",
                    "the roast", "the new cookbook", "the pastry"],
        "verb": ["needs", "tastes better with", "was simmered with", "calls for", "was baked with", "pairs well with",
                 "is seasoned with", "was served with"],
        "object": ["fresh garlic", "butter and herbs", "a pinch of salt", "roasted peppers", "olive oil",
                   "brown sugar", "toasted nuts", "lemon zest"],
        "tail": ["for twenty minutes", "in a hot oven", "over low heat", "before serving", "on the stove", "until golden",
                 ""],
    },
    "technology": {
        "subject": ["the new phone", "the laptop", "the software update", "the startup", "the server", "the app",
                    "the graphics card", "the compiler", "the database", "the browser"],
        "verb": ["crashed after", "was released with", "runs faster with", "supports", "was patched for",
                 "ships with", "struggles with", "was benchmarked with"],
        "object": ["more memory", "a faster processor", "the latest firmware", "a security fix", "cloud storage",
                   "a bigger battery", "new drivers", "machine learning features"],
        "tail": ["last week", "according to reviewers", "on every platform", "for developers", "out of the box",
                 "in the beta", ""],
    },
}


def generate(n: int, rng: random.Random, exclude: set[str] = frozenset()) -> list[dict[str, str]]:  # type: ignore[assignment]
    labels = sorted(TOPICS)
    out, seen = [], set(exclude)
    while len(out) < n:
        label = labels[len(out) % len(labels)]
        t = TOPICS[label]
        words = [rng.choice(OPENERS), rng.choice(t["subject"]), rng.choice(t["verb"]), rng.choice(t["object"]),
                 rng.choice(t["tail"])]
        text = " ".join(w for w in words if w) + "."
        if text in seen:
            continue
        seen.add(text)
        out.append({"text": text[0].upper() + text[1:], "label": label})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusec.train.topics", description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", required=True, metavar="DIR")
    p.add_argument("--train", type=int, default=480)
    p.add_argument("--heldout", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    train = generate(args.train, random.Random(args.seed))
    held = generate(args.heldout, random.Random(args.seed + 7919), exclude={r["text"].lower() for r in train})
    write_splits(args.output, train, held)
    print(f"wrote {len(train)} training and {len(held)} held-out texts to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
