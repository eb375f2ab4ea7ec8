"""Quality-eval cases, each generated from (task, length, index, seed): the same arguments always give the same
document and question, and a larger index always gives a new case, so more can be drawn at any time.

Every generated document is book prose (Project Gutenberg, ../shared/data/books) with the task's material
inserted at random depths, padded RULER-style to the target length in the model's tokens.

- babilong:    a bAbI qa1/qa2 story (the facts before one question, in order) hidden in prose.
- multihop:    a 2-3 fact chain about invented names at random depths, plus near-miss distractors (a name one
               letter off, linked to a wrong answer); the question needs every fact of the chain.
- aggregation: CWE in prose: ledger entries scattered through a book; which 10 items are listed most often?
               Scored by set F1.
- hotpotqa:    a HotpotQA question (distractor setting: 2 gold + 8 distractor paragraphs) in prose.
- squad:       a SQuAD 2.0 answerable question: its paragraph and 3 others of the same article, in prose.
- unanswerable: a SQuAD 2.0 unanswerable question: the paragraph it was written against (which holds a plausible
               but wrong answer) and 3 others, in prose; the right answer says the document does not say.
- babilong-sample: the two shared BABILong samples (fixed documents, about 8k and 16k GPT-4 tokens).
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

from .common import BOOKS, SHARED, n_tokens

TASKS = ("babilong", "multihop", "aggregation", "hotpotqa", "squad", "unanswerable")
FIXED_TASKS = ("babilong-sample",)
BABILONG_TASKS = ("babilong", "babilong-sample")  # scored by BABILong's own check (bench/eval.py:babilong_score)
KINDS = {"aggregation": "list", "unanswerable": "unanswerable"}  # each task's Case.kind; the others: "short"
PROSE_BOOKS = ("pg1342.txt", "pg1661.txt", "pg84.txt", "pg11.txt")


@dataclass
class Case:
    """One question on one document. `info["gold"]`: the inserted texts that hold the answer (a segment that
    contains one holds a gold fact: what a margin's relevance should find)."""
    task: str
    length: int                  # target length in tokens (for fixed samples: their own length)
    index: int
    text: str
    query: str
    answers: list[str]           # any of these counts (short answers); the gold set (lists)
    kind: str = "short"          # short | list | unanswerable (right when the answer says it is not stated)
    answer_tokens: int = 32
    info: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"


# ---- haystack ----------------------------------------------------------------------------------------------------
_SENTENCE_END = re.compile(r"[.!?][\"'”’)]*\s+(?=[A-Z\"“'‘(_])")
_NOT_AN_END = re.compile(r"(\b[A-Z]|\bM[rs]|\bMrs|\bDr|\bSt|\bNo)\.$")  # initials and abbreviations


def _sentences(text: str) -> list[str]:
    cuts = [0, *(m.end() for m in _SENTENCE_END.finditer(text)
                 if not _NOT_AN_END.search(text[max(0, m.start() - 4):m.start() + 1])), len(text)]
    return [text[a:b].strip() for a, b in zip(cuts, cuts[1:])]


@lru_cache(maxsize=None)
def _book(name: str) -> str:
    return (BOOKS / name).read_text(encoding="utf-8")


def _prose_units(rng: random.Random, tokenizer, tokens: int, by: str) -> list[str]:
    """About `tokens` tokens of consecutive prose from a random book and place, as whole sentences or paragraphs."""
    text = _book(rng.choice(PROSE_BOOKS))
    start = rng.randrange(0, max(1, len(text) - tokens * 6))
    start = text.find("\n\n", start) + 2 if text.find("\n\n", start) >= 0 else start
    chunk = text[start:start + tokens * 6]
    enc = tokenizer(chunk, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) > tokens:
        chunk = chunk[:enc["offset_mapping"][tokens][0]]
    if by == "paragraph":
        units = [u.strip() for u in chunk.split("\n\n")]
    else:  # sentences, their line breaks unwrapped (Gutenberg hard-wraps lines at ~70 characters)
        units = _sentences(re.sub(r"\s*\n\s*", " ", chunk))
    units = [u for u in units if u]
    return units[:-1] if len(units) > 1 else units  # the last one is cut mid-way


def haystack(rng: random.Random, tokenizer, length: int, needles: list[str], ordered: bool = True,
             by: str = "sentence") -> tuple[str, list[float]]:
    """Prose with `needles` inserted between its sentences (or paragraphs) at random depths, `length` tokens in
    all (a little under: whole sentences only). Returns the text and each needle's depth (0 start, 1 end)."""
    state = rng.getstate()
    budget = max(64, length - sum(n_tokens(tokenizer, n) for n in needles))
    for _ in range(3):  # whole sentences only and token merges at the joins: converge on the length
        rng.setstate(state)
        text, depth = _assemble(rng, tokenizer, budget, needles, ordered, by)
        short = length - n_tokens(tokenizer, text)
        if 0 <= short < max(16, length // 100):
            break
        budget += short
    return text, depth


def _assemble(rng, tokenizer, budget, needles, ordered, by):
    units = _prose_units(rng, tokenizer, budget, by)
    slots = sorted(rng.randrange(len(units) + 1) for _ in needles)
    order = list(range(len(needles)))
    if not ordered:
        rng.shuffle(order)
    placed: dict[int, list[int]] = {}
    for slot, i in zip(slots, order):
        placed.setdefault(slot, []).append(i)
    parts, depth = [], [0.0] * len(needles)
    for k in range(len(units) + 1):
        for i in placed.get(k, []):
            depth[i] = round(k / max(1, len(units)), 3)
            parts.append(needles[i])
        if k < len(units):
            parts.append(units[k])
    return ("\n\n" if by == "paragraph" else " ").join(parts), depth


# ---- babilong ----------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _babi(task_file: str) -> list[tuple[list[str], str, str]]:
    """(facts before the question, question, answer) for every question of a bAbI file."""
    items, story = [], []
    for line in (SHARED / "babi" / task_file).read_text().splitlines():
        num, _, rest = line.partition(" ")
        if num == "1":
            story = []
        if "\t" in rest or "|" in rest:  # qa2 uses tabs (as the README says), qa1 "|"
            question, answer, _ = re.split(r"[\t|]", rest)
            items.append((list(story), question.strip(), answer.strip()))
        else:
            story.append(rest.strip())
    return items


def babilong(rng, tokenizer, length):
    name = rng.choice(["qa1_single-supporting-fact_test.txt", "qa2_two-supporting-facts_test.txt"])
    facts, question, answer = rng.choice(_babi(name))
    text, depth = haystack(rng, tokenizer, length, facts, ordered=True)
    return dict(text=text, query=question, answers=[answer], info={"babi": name[:3], "facts": len(facts),
                                                                    "depth": depth, "gold": facts})


# ---- multi-hop needles -------------------------------------------------------------------------------------------
_SYLLABLES = ["ka", "ro", "mel", "va", "dri", "sto", "len", "qua", "bor", "tis", "ne", "gal", "fen", "ul", "mar",
              "ost", "pra", "ven", "hol", "ith", "ska", "dun", "rel", "zo", "cal", "bri", "tor", "wen", "ashe", "lum"]
_ADJ = ["Copper", "Silver", "Crooked", "Golden", "Quiet", "Scarlet", "Hollow", "Northern", "Velvet", "Iron"]
_NOUN = ["Lantern", "Anvil", "Heron", "Compass", "Thistle", "Kettle", "Barrel", "Feather", "Bell", "Mill"]
_KIND = ["Inn", "Bakery", "Forge", "Bookshop", "Tannery", "Workshop", "Apothecary", "Brewery"]
_PRODUCTS = ["glass bells", "salted plums", "blue cheese", "river pearls", "woollen shawls", "clockwork birds",
             "honey cakes", "painted kites", "copper pans", "rope bridges", "lavender soap", "black tea"]


def _word(rng, syllables=(2, 3)) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice(syllables))).capitalize()


def _near(rng, name: str) -> str:
    """One vowel changed: a near-miss of `name`."""
    spots = [i for i, c in enumerate(name) if c in "aeiou" and i > 0]
    i = rng.choice(spots) if spots else len(name) - 1
    return name[:i] + rng.choice([v for v in "aeiou" if v != name[i]]) + name[i + 1:]


def multihop(rng, tokenizer, length):
    hops = rng.choice([2, 3])
    person = f"{_word(rng)} {_word(rng)}"
    if rng.random() < 0.5:
        business = f"{rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_KIND)}"
        town, river = _word(rng), _word(rng, (2,))
        chain = [f"{person} works at the {business}.", f"The {business} is in the town of {town}.",
                 f"The town of {town} lies on the river {river}."]
        other_business = f"{rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_KIND)}"
        near_business = business.rsplit(" ", 1)[0] + " " + rng.choice([k for k in _KIND if k not in business])
        distractors = [f"{_near(rng, person)} works at the {other_business}.",
                       f"The {near_business} is in the town of {_word(rng)}.",
                       f"The town of {_near(rng, town)} lies on the river {_word(rng, (2,))}."]
        questions = {2: (f"In which town does {person} work?", town),
                     3: (f"On which river lies the town where {person} works?", river)}
    else:
        sibling, city = _word(rng), _word(rng)
        product = rng.choice(_PRODUCTS)
        chain = [f"{person}'s sister is called {sibling}.", f"{sibling} lives in the city of {city}.",
                 f"The city of {city} is famous for its {product}."]
        distractors = [f"{_near(rng, person)}'s sister is called {_word(rng)}.",
                       f"{_near(rng, sibling)} lives in the city of {_word(rng)}.",
                       f"The city of {_near(rng, city)} is famous for its "
                       f"{rng.choice([p for p in _PRODUCTS if p != product])}."]
        questions = {2: (f"In which city does {person}'s sister live?", city),
                     3: (f"What is the city where {person}'s sister lives famous for?", product)}
    query, answer = questions[hops]
    needles = chain[:hops] + distractors[:hops]
    text, depth = haystack(rng, tokenizer, length, needles, ordered=False)
    return dict(text=text, query=query, answers=[answer], info={"hops": hops, "chain": chain[:hops],
                                                                "distractors": distractors[:hops], "depth": depth,
                                                                "gold": chain[:hops]})


# ---- aggregation (CWE in prose) -------------------------------------------------------------------------------
ITEMS = ["lantern", "compass", "kettle", "saddle", "telescope", "candlestick", "inkwell", "hourglass", "violin",
         "umbrella", "anchor", "teapot", "bellows", "spyglass", "harpoon", "ladle", "padlock", "thimble", "quill",
         "birdcage", "chessboard", "tinderbox", "snuffbox", "paperweight", "trowel", "lute", "sextant", "mortar",
         "whistle", "flagon", "hatbox", "pitchfork", "weathervane", "rolling pin", "music box", "fishing rod",
         "sewing basket", "wheelbarrow", "coffee mill", "pocket watch"]
_LEDGER = ["The ledger records one {item}.", "Item entered in the ledger: a {item}.",
           "Ledger entry: one {item}, in good order.", "In the ledger, another line reads: {item}."]


def aggregation(rng, tokenizer, length):
    common, rare = (6, 2) if length <= 5000 else (10, 3)   # RULER CWE, scaled to fit prose at 4k / 8k
    if length < 2000:
        common, rare = 3, 1
    items = rng.sample(ITEMS, 30)
    top, others = items[:10], items[10:]
    entries = [rng.choice(_LEDGER).format(item=it) for it in top for _ in range(common)]
    entries += [rng.choice(_LEDGER).format(item=it) for it in others for _ in range(rare)]
    rng.shuffle(entries)
    text, _ = haystack(rng, tokenizer, length, entries, ordered=True)
    query = ("Ledger entries are scattered through the text. Which 10 items does the ledger record most often? "
             "List the 10 items, separated by commas.")
    return dict(text=text, query=query, answers=top, answer_tokens=64,
                info={"per_common": common, "per_rare": rare, "rare": others,
                      "gold": [e for e in entries if any(it in e for it in top)]})


# ---- HotpotQA and SQuAD in prose -----------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _hotpot() -> list[dict]:
    return json.loads((SHARED / "hotpotqa" / "hotpot_dev_distractor_v1_first53.json").read_text())


@lru_cache(maxsize=None)
def _squad(impossible: bool = False) -> list[tuple[str, list[str], str, list[str]]]:
    """(question, answers, its paragraph, other paragraphs of the article) for every answerable question (or,
    `impossible`, every unanswerable one, with the plausible answers SQuAD lists for it)."""
    out = []
    for article in json.loads((SHARED / "squad" / "squad2_dev_half_cs224n.json").read_text())["data"]:
        paragraphs = [p["context"] for p in article["paragraphs"]]
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                if qa["is_impossible"] == impossible:
                    given = qa["plausible_answers"] if impossible else qa["answers"]
                    answers = list(dict.fromkeys(a["text"] for a in given))
                    out.append((qa["question"], answers, p["context"], [c for c in paragraphs if c != p["context"]]))
    return out


def _fitting(tokenizer, length: int, gold: list[str], extra: list[str]) -> list[str]:
    """Gold paragraphs plus as many distractors as fit in three quarters of the length (the rest is prose)."""
    chosen, used = list(gold), sum(n_tokens(tokenizer, p) for p in gold)
    for p in extra:
        t = n_tokens(tokenizer, p)
        if used + t > 0.75 * length:
            break
        chosen.append(p)
        used += t
    return chosen


def _pick(rng, index: int, pool: int, seed_key: str) -> int:
    """Draw without replacement: case `index` takes the index-th element of a seeded permutation of the pool
    (after the pool is used up, a new permutation: same question, new haystack)."""
    perm = list(range(pool))
    random.Random(f"{seed_key}:{index // pool}").shuffle(perm)
    return perm[index % pool]


def hotpotqa(rng, tokenizer, length, index, seed):
    data = _hotpot()
    ex = data[_pick(rng, index, len(data), f"{seed}:hotpot")]
    paragraphs = {title: f"{title}: {''.join(s).strip()}" for title, s in ex["context"]}
    gold_titles = list(dict.fromkeys(t for t, _ in ex["supporting_facts"]))
    gold = [paragraphs[t] for t in gold_titles]
    extra = [p for t, p in paragraphs.items() if t not in gold_titles]
    text, depth = haystack(rng, tokenizer, length, _fitting(tokenizer, length, gold, extra), ordered=False,
                           by="paragraph")
    return dict(text=text, query=ex["question"], answers=[ex["answer"]],
                info={"id": ex["_id"], "type": ex["type"], "gold_depth": depth[:len(gold)], "gold": gold})


def squad(rng, tokenizer, length, index, seed):
    data = _squad()
    question, answers, paragraph, others = data[_pick(rng, index, len(data), f"{seed}:squad")]
    extra = rng.sample(others, min(3, len(others)))
    text, depth = haystack(rng, tokenizer, length, _fitting(tokenizer, length, [paragraph], extra), ordered=False,
                           by="paragraph")
    return dict(text=text, query=question, answers=answers, info={"gold_depth": depth[0], "gold": [paragraph]})


def unanswerable(rng, tokenizer, length, index, seed):
    # Paragraphs of up to about half the length (some run to thousands of tokens): the rest stays prose.
    data = [d for d in _squad(impossible=True) if len(d[2]) <= 2 * length]
    question, plausible, paragraph, others = data[_pick(rng, index, len(data), f"{seed}:unanswerable")]
    extra = rng.sample(others, min(3, len(others)))
    text, depth = haystack(rng, tokenizer, length, _fitting(tokenizer, length, [paragraph], extra), ordered=False,
                           by="paragraph")
    return dict(text=text, query=question, answers=["The document does not say."],
                info={"gold_depth": depth[0], "gold": [paragraph], "plausible": plausible})


# ---- the shared BABILong samples -------------------------------------------------------------------------------
def babilong_samples(tokenizer) -> list[Case]:
    cases = []
    for i, name in enumerate(("babilong_8k.json", "babilong_16k.json")):
        data = json.loads((SHARED / "babilong" / name).read_text())
        cases.append(Case("babilong-sample", n_tokens(tokenizer, data["context"]), i, data["context"],
                          data["query"].strip(), [data["target"]], info={"file": name}))
    return cases


GENERATORS = {"babilong": babilong, "multihop": multihop, "aggregation": aggregation, "hotpotqa": hotpotqa,
              "squad": squad, "unanswerable": unanswerable}


def make_case(task: str, length: int, index: int, tokenizer, seed: int = 0) -> Case:
    rng = random.Random(f"{seed}:{task}:{length}:{index}")
    gen = GENERATORS[task]
    made = gen(rng, tokenizer, length, index, seed) if task in ("hotpotqa", "squad", "unanswerable") else gen(rng, tokenizer, length)
    return Case(task, length, index, kind=KINDS.get(task, "short"), **made)
