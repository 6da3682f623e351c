"""A seeded ATIS-like dataset for the joint intent/slot model: templated air-travel requests with
an intent and BIO slot tags per token (the seed post-mortem's task, without its data).

    python -m fusec.train.atis_like -o DIR [--train 4000] [--heldout 800] [--seed 0]

writes ``DIR/train.jsonl`` and ``DIR/heldout.jsonl`` (``{"tokens", "intent", "slots"}`` per line,
``fusec.train.data``'s intent/slot format). The held-out split is drawn from its own random
stream, and sentences that also occur in the training split are dropped from it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from collections.abc import Sequence

CITIES = ["boston", "denver", "atlanta", "dallas", "pittsburgh", "baltimore", "philadelphia", "san francisco",
          "oakland", "washington", "new york", "los angeles", "miami", "chicago", "seattle", "houston", "phoenix",
          "detroit", "cleveland", "memphis", "nashville", "orlando", "tampa", "charlotte", "milwaukee", "minneapolis",
          "st. louis", "kansas city", "salt lake city", "las vegas", "san diego", "san jose", "toronto", "montreal",
          "indianapolis", "columbus", "cincinnati", "newark", "burbank", "long beach", "st. paul", "ontario",
          "westchester county", "fort worth", "tacoma"]
SLOT_VALUES = {
    "airline_name": ["american airlines", "delta", "united", "us air", "continental", "northwest", "twa",
                     "alaska airlines", "america west", "lufthansa", "air canada", "midwest express", "southwest"],
    "airline_code": ["aa", "dl", "ua", "us", "co", "nw", "as", "hp", "ac", "wn"],
    "depart_date.day_name": ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"],
    "depart_date.month_name": ["january", "february", "march", "april", "may", "june", "july", "august",
                               "september", "october", "november", "december"],
    "depart_date.day_number": ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
                               "tenth", "eleventh", "twelfth", "fifteenth", "twentieth", "twenty first",
                               "twenty fifth", "thirtieth"],
    "depart_date.date_relative": ["today", "tomorrow", "next week", "this weekend"],
    "depart_time.period_of_day": ["morning", "afternoon", "evening", "night", "early morning", "late evening"],
    "depart_time.time": ["6 am", "7 am", "8 am", "9 am", "10 am", "noon", "1 pm", "2 pm", "3 pm", "5 pm", "6 pm",
                         "8 pm", "10 pm", "7 o'clock", "830 am", "1130 am"],
    "class_type": ["first class", "business class", "economy", "coach", "thrift"],
    "round_trip": ["round trip", "one way"],
    "cost_relative": ["cheapest", "lowest", "least expensive", "most expensive"],
    "flight_mod": ["earliest", "latest", "last", "first"],
    "transport_type": ["taxi", "limousine", "rental car", "bus", "air taxi operation", "subway"],
    "fare_basis_code": ["qx", "qw", "y", "f", "h", "bh", "m", "qo"],
    "aircraft_code": ["737", "747", "757", "767", "dc9", "dc10", "m80", "72s", "d9s"],
    "meal": ["breakfast", "lunch", "dinner", "snack"],
}
for _k in ("fromloc.city_name", "toloc.city_name", "city_name", "stoploc.city_name"):
    SLOT_VALUES[_k] = CITIES

MACROS = {
    "from": ["from {fromloc.city_name}", "leaving {fromloc.city_name}", "out of {fromloc.city_name}"],
    "to": ["to {toloc.city_name}", "arriving in {toloc.city_name}", "going to {toloc.city_name}", "into {toloc.city_name}"],
    "date": ["on {depart_date.day_name}", "on {depart_date.month_name} {depart_date.day_number}",
             "{depart_date.date_relative}", "on {depart_date.day_name} {depart_time.period_of_day}",
             "{depart_date.day_name} {depart_time.period_of_day}", "in the {depart_time.period_of_day}",
             "at {depart_time.time}", "before {depart_time.time}", "after {depart_time.time}"],
    "please": ["", "please", "i would like to know", "can you tell me", "could you"],
    "show": ["show me", "list", "give me", "find", "i need", "i would like", "what are", "are there any"],
}
TEMPLATES = {
    "flight": ["{show} flights {from} {to} [{date}]", "{show} [{flight_mod}] flights {from} {to} [{date}]",
               "i want to fly {from} {to} [{date}]", "{show} {airline_name} flights {from} {to} [{date}]",
               "i need a [{round_trip}] flight {from} {to} [{date}]",
               "what flights go {from} {to} [with a stop in {stoploc.city_name}] [{date}]",
               "{show} [{class_type}] flights {to} {from} [{date}]",
               "{please} book a {class_type} seat on a flight {from} {to} [{date}]",
               "is there a [{meal}] flight {from} {to} [{date}]", "flights {from} {to} [{date}]"],
    "airfare": ["how much is a [{round_trip}] {class_type} ticket {from} {to}", "what is the {cost_relative} fare {from} {to}",
                "{show} [{round_trip}] fares {from} {to} [on {airline_name}]", "{please} what does it cost to fly {from} {to}",
                "what are the {cost_relative} [{round_trip}] tickets {from} {to} [{date}]",
                "price of a [{class_type}] ticket {from} {to}"],
    "ground_service": ["what ground transportation is available in {city_name}",
                       "is there a {transport_type} from the {city_name} airport to downtown",
                       "how do i get from the airport to downtown {city_name}",
                       "{show} ground transportation [in {city_name}]",
                       "{please} how much is a {transport_type} in {city_name}"],
    "airline": ["which airlines fly {from} {to}", "what airlines have flights {from} {to} [{date}]",
                "{show} the airlines {from} {to}", "which airline offers {class_type} service {from} {to}",
                "does {airline_name} fly {from} {to}"],
    "flight_time": ["what time does the {airline_name} flight {from} {to} leave",
                    "when do flights {from} arrive {to} [{date}]", "{please} what are the departure times {from} {to}",
                    "what time is the {flight_mod} flight {from} {to} [{date}]",
                    "{show} the schedule of flights {from} {to}"],
    "aircraft": ["what kind of aircraft is used on the flight {from} {to} [{date}]",
                 "what type of plane does {airline_name} fly {from} {to}", "what is a {aircraft_code}",
                 "{please} what aircraft is the {airline_name} flight {from} {to}",
                 "how many seats are on a {aircraft_code}"],
    "distance": ["how far is {city_name} airport from downtown", "what is the distance {from} {to}",
                 "{please} how long is the trip {from} {to}", "how many miles is it {from} {to}"],
    "abbreviation": ["what does fare code {fare_basis_code} mean", "what is {airline_code}",
                     "{please} what does {fare_basis_code} stand for", "explain the restriction {fare_basis_code}",
                     "which airline is {airline_code}"],
}
_PLACEHOLDER = re.compile(r"\{([a-z_.]+)\}")


def _expand(text: str, rng: random.Random) -> list[tuple[str, str]]:
    """(word, BIO tag) pairs of one random sentence of ``text``: optional [groups] kept with
    probability 1/2, macros expanded, slots filled with a random value."""
    text = re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1) if rng.random() < 0.5 else "", text)
    out: list[tuple[str, str]] = []
    for piece in text.split():
        m = _PLACEHOLDER.fullmatch(piece)
        if m is None:
            out.append((piece, "O"))
            continue
        name = m.group(1)
        if name in MACROS:
            out += _expand(rng.choice(MACROS[name]), rng)
        else:
            words = rng.choice(SLOT_VALUES[name]).split()
            out += [(w, ("B-" if i == 0 else "I-") + name) for i, w in enumerate(words)]
    return out


def generate(n: int, rng: random.Random, exclude: set[str] = frozenset()) -> list[dict[str, object]]:  # type: ignore[assignment]
    intents = sorted(TEMPLATES)
    out, seen = [], set(exclude)
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        intent = rng.choice(intents)
        pairs = _expand(rng.choice(TEMPLATES[intent]), rng)
        sentence = " ".join(w for w, _ in pairs)
        if sentence in seen:
            continue
        seen.add(sentence)
        out.append({"tokens": [w for w, _ in pairs], "intent": intent, "slots": [t for _, t in pairs]})
    return out


def write(path: str, records: Sequence[dict[str, object]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_splits(output: str, train: Sequence[dict[str, object]], held: Sequence[dict[str, object]]) -> None:
    """``output``/train.jsonl and ``output``/heldout.jsonl (the directory made if missing)."""
    os.makedirs(output, exist_ok=True)
    write(os.path.join(output, "train.jsonl"), train)
    write(os.path.join(output, "heldout.jsonl"), held)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusec.train.atis_like", description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="directory for train.jsonl and heldout.jsonl")
    p.add_argument("--train", type=int, default=4000, help="training sentences (default 4000)")
    p.add_argument("--heldout", type=int, default=800, help="held-out sentences (default 800)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    train = generate(args.train, random.Random(args.seed))
    held = generate(args.heldout, random.Random(args.seed + 1_000_003), exclude={" ".join(r["tokens"]) for r in train})
    write_splits(args.output, train, held)
    print(f"wrote {len(train)} training and {len(held)} held-out sentences to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
