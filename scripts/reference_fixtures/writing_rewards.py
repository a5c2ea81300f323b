"""Reference outputs of the writing rewards, for tests/test_writing_reward_paper.py.

Runs the reference reward functions of OpenMLRL/LLM_Collab_Writing (tldr_combined_reward,
arxiv_combined_reward) on a seeded, crafted set of text pairs and writes
tests/fixtures/writing_reward_paper_{tldr,arxiv}.jsonl.gz: a first line {"meta": ...}, then one
line per pair {"kind", "text1", "text2", "reward", "reached"}. `reward` is the reference's value;
`reached` the last level the reference entered (1 structure .. 4 style), read from its verbose
report. The reference code is imported from the given checkout and never enters this repository.

Generated against commit 7e59995e20251de8819bdf2a57d8296193cb2b03. To regenerate:

    git clone https://github.com/OpenMLRL/LLM_Collab_Writing /tmp/ref_writing
    git -C /tmp/ref_writing checkout 7e59995e20251de8819bdf2a57d8296193cb2b03
    python scripts/reference_fixtures/writing_rewards.py /tmp/ref_writing

(only `rewards/*.py` is needed; they import nothing outside the standard library, so any
Python 3.9+ runs this, no project venv or extra packages). --commit records the commit when the
checkout is not a git work tree. The inputs depend only on --seed and the phrase and stopword
lists in src/marl_llm/tasks/writing_reward_paper.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import io
import json
import random
import re
import sys
from pathlib import Path

from checkout import git_commit  # scripts/reference_fixtures/checkout.py
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[2]
DATA = json.loads((REPO / "src/marl_llm/tasks/writing_reward_paper.json").read_text(encoding="utf-8"))
OUT_DIR = REPO / "tests/fixtures"
MIN_PAIRS = 1040

# Consonant-only word material: no transition phrase and no stopword of 4+ letters lacks a vowel,
# so salads built from it trigger no transition category and contain no stopword.
CONS = "bcdfghjklmnpqrstvwxz"
STOPWORDS = DATA["stopwords"]
TRANSITIONS: dict[str, list[str]] = DATA["transitions"]
# Words that contain a transition phrase (or a stopword) as a raw substring.
CARRIERS = ["has", "was", "also", "cashier", "different", "butterfly", "nowhere", "stillness", "firstborn",
            "whenever", "sincerely", "thenceforth", "shoulder", "hadron", "werewolf", "gathering", "yesterday",
            "beforehand", "afterglow", "collateral", "thusly", "nextdoor", "rathskeller", "ifrit", "assess",
            "untilled", "earliest", "lately", "finalist", "secondhand", "thirdhand", "indeedy", "surely",
            "naturalist", "granted", "stillwater", "unless", "whereupon", "nonetheless", "basically"]
CONTRACTIONS = ["don't", "it's", "they're", "we've", "can't", "won't", "o'clock", "rock'n'roll", "i'm", "you'll",
                "shouldn't", "that's", "isn't", "'tis", "ma'am", "y'all"]
UNICODE_WORDS = ["café", "naïve", "über", "straße", "résumé", "日本語のテキスト", "ΑΒΓΔ", "αβγδ", "İstanbul", "ﬁnance",
                 "🙂", "１２３", "x²", "Ωmega", "ǅungla", "ﬀ", "Ⅻ", "٣٤٥", "añejo", "Ærø", "ĳssel", "snake_case",
                 "foo-bar", "e-mail", "3.14", "#hash", "@user", "naïveté", "ﬂow", "ΣΊΣΥΦΟΣ"]
WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\xa0", "\u2003", "\u3000", "\u2028", "\x0b", "\x0c", "\x1c",
              "\x85", " \t \n "]
NOT_WHITESPACE = ["\u200b", "\u2060", "\ufeff"]  # zero-width: join tokens for str.split()
ENGLISH = """model data result method paper study system approach network learning training agent policy reward
value task language text summary post user friend family work job money house car school week month year day
night problem question answer idea plan change people team project code test experiment analysis evidence
theory design process structure feature signal noise sample batch layer weight gradient loss metric score
baseline benchmark dataset corpus token sentence paragraph story detail context author reader writer editor
simple complex large small fast slow early recent strong weak clear useful robust novel standard general
specific important different similar better worse major minor show find propose improve reduce increase
build train evaluate compare measure describe explain discuss suggest consider provide require allow
achieve perform obtain observe report present introduce extend combine apply""".split()


def load_reference(checkout: Path) -> dict[str, Callable]:
    funcs = {}
    for task, fn in (("tldr", "tldr_combined_reward"), ("arxiv", "arxiv_combined_reward")):
        path = checkout / "rewards" / f"{task}_rewards.py"
        spec = importlib.util.spec_from_file_location(f"_reference_{task}_rewards", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.VERBOSE = True  # its report tells which level it reached
        funcs[task] = getattr(module, fn)
    return funcs


def run_reference(func: Callable, text1: str, text2: str) -> tuple[float, int]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        (reward,) = func([text1], [text2])
    reached = max(int(n) for n in re.findall(r"LEVEL (\d):", buf.getvalue()))
    return reward, reached


# ------------------------------------------------------------------------------ text builders
class Words:
    """Distinct consonant words: prefix + a 3-letter code (unique per word) + optional filler."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def make(self, prefix: str, n: int) -> list[str]:
        codes = self.rng.sample(range(len(CONS) ** 3), n)
        return [prefix + CONS[c // 400] + CONS[(c // 20) % 20] + CONS[c % 20] for c in codes]


def salad(rng: random.Random, words: Words, n_tokens: int, n_unique: int, n_chars: int | None = None,
          prefix: str = "q", extra: list[str] | None = None) -> str:
    """n_tokens whitespace tokens over n_unique distinct words (plus `extra` tokens counted in both),
    padded to exactly n_chars characters when possible (filler letters, then extra inner spaces)."""
    extra = list(extra or [])
    n_own = max(n_tokens - len(extra), 0)
    uniq = words.make(prefix, min(n_unique, n_own)) if n_own else []
    toks = uniq + [rng.choice(uniq) for _ in range(n_own - len(uniq))] if uniq else []
    toks += extra
    rng.shuffle(toks)
    text = " ".join(toks)
    if n_chars is None or len(text) >= n_chars:
        return text
    deficit = n_chars - len(text)
    counts = {t: toks.count(t) for t in set(toks)}
    singles = [i for i, t in enumerate(toks) if counts[t] == 1 and t in uniq]
    rng.shuffle(singles)
    for i in singles:
        if deficit <= 0:
            break
        add = min(deficit, rng.randint(1, 6))
        toks[i] += "z" * add
        deficit -= add
    gaps = [" "] * (len(toks) - 1)
    i = 0
    while deficit > 0 and gaps:
        gaps[i % len(gaps)] += " "
        deficit -= 1
        i += 1
    out = toks[0] + "".join(g + t for g, t in zip(gaps, toks[1:])) if toks else ""
    return out


def min_chars(n_tokens: int, prefix: str = "q") -> int:
    return n_tokens * (len(prefix) + 4) - 1


def pair(rng, words, n1, u1, n2, u2, ratio, d=0, shared=0, chars1=None, extra1=None, extra2=None):
    """text1 (n1 tokens, u1 distinct) and text2 with len(text2) = round(ratio * len(text1)) + d."""
    shared_words = words.make("k", shared) if shared else []
    e1 = shared_words + list(extra1 or [])
    e2 = shared_words + list(extra2 or [])
    base1 = max(min_chars(n1) + sum(len(w) for w in e1), chars1 or 0)
    need2 = min_chars(n2) + sum(len(w) for w in e2)
    c1 = max(base1, int(need2 / ratio) + 2)
    if chars1 and c1 > chars1:
        c1 = chars1
    t1 = salad(rng, words, n1, u1, c1, "q", e1)
    t2 = salad(rng, words, n2, u2, round(ratio * len(t1)) + d, "v", e2)
    return t1, t2


def sentence_text(rng: random.Random, n_tokens: int, transition_rate: float = 0.1, stop_rate: float = 0.35,
                  cats: list[str] | None = None) -> str:
    """English-like text: bank words, stopwords, transition phrases, punctuation, capitals."""
    toks: list[str] = []
    pool = cats or list(TRANSITIONS)
    while len(toks) < n_tokens:
        x = rng.random()
        if x < transition_rate:
            phrase = rng.choice(TRANSITIONS[rng.choice(pool)])
            toks += (phrase.capitalize() + ",").split() if rng.random() < 0.5 else phrase.split()
        elif x < transition_rate + stop_rate:
            toks.append(rng.choice(STOPWORDS))
        else:
            w = rng.choice(ENGLISH)
            toks.append(w + rng.choice(["", "", "", "", ".", ",", ";", ":"]))
    return " ".join(toks[:n_tokens])


# ---------------------------------------------------------------------------------- cases
def cases(task: str, rng: random.Random) -> Iterator[tuple[str, str, str]]:
    p = DATA["tasks"][task]
    lo_w, hi_w = p["words"]
    lr = p["length_ratio"]
    vr = [x for x in p["vocabulary_ratio"] if x is not None]
    W = Words(rng)
    arxiv = task == "arxiv"
    # A passing baseline: mid length band, vocabulary ratio inside the full band.
    mid_len = (lr[1] + lr[2]) / 2
    n1 = 150 if arxiv else 12
    u1 = 60 if arxiv else 6
    n2 = 150 if arxiv else 30
    u2 = 60 if arxiv else 20

    def base(**kw):
        args = dict(n1=n1, u1=u1, n2=n2, u2=u2, ratio=mid_len)
        args.update(kw)
        return pair(rng, W, args.pop("n1"), args.pop("u1"), args.pop("n2"), args.pop("u2"), args.pop("ratio"), **args)

    # 1. word-count gates, both texts, around both bounds.
    gate = [lo_w - 1, lo_w, lo_w + 1, hi_w - 1, hi_w, hi_w + 1, 0, 1]
    for a in gate:
        for b in gate:
            ua = max(1, a // 2)
            ub = max(1, b // 2) if arxiv else max(1, min(b, 2 * ua + 2))
            if a == 0 or b == 0:
                t1 = "" if a == 0 else salad(rng, W, a, ua)
                t2 = "" if b == 0 else salad(rng, W, b, ub, prefix="v")
            else:
                t1, t2 = pair(rng, W, a, ua, b, ub, mid_len)
            yield "word_gate", t1, t2
    # 2. length ratio around every band edge (exact hits on multiples of 10 chars, and +- a few chars).
    for edge in lr:
        for c1 in ((1000, 1230, 1370) if arxiv else (100, 130, 170)):
            for d in (-3, -1, 0, 1, 3):
                t1, t2 = base(chars1=c1, ratio=edge, d=d, n2=(130 if arxiv else 20), u2=(55 if arxiv else 13),
                              n1=(130 if arxiv else 10), u1=(55 if arxiv else 5))
                yield "length_edge", t1, t2
    # 3. vocabulary ratio around every band edge, several denominators.
    for edge in vr:
        for uu in ((40, 50, 61, 77) if arxiv else (5, 7, 10, 13)):
            for du in (-1, 0, 1):
                v2 = max(1, round(edge * uu) + du)
                if arxiv:
                    t1, t2 = base(n1=200, u1=uu, n2=200, u2=v2, ratio=1.45)
                else:
                    t1, t2 = base(n1=max(8, uu), u1=uu, n2=max(8, v2), u2=v2, ratio=2.4)
                yield "vocabulary_edge", t1, t2
    # 4. Jaccard around the cap (shared content words), transition-free salads.
    for s in range(0, 8 if not arxiv else 40, 1 if not arxiv else 3):
        t1, t2 = base(shared=s, u1=(60 if arxiv else 10), u2=(60 if arxiv else 25), n1=(150 if arxiv else 12),
                      n2=(150 if arxiv else 30))
        yield "jaccard_cap", t1, t2
    # 5. transitions: k categories (0..12), one phrase each, in text 2 (and for arXiv in text 1 too).
    cat_names = list(TRANSITIONS)
    for k in range(13):
        for rep in range(6):
            chosen = rng.sample(cat_names, k)
            phrases = [rng.choice(TRANSITIONS[c]) for c in chosen]
            tokens = [t for ph in phrases for t in ph.split()]
            where = rep % 3 if arxiv else 1
            e1 = tokens if where == 0 else (tokens[: len(tokens) // 2] if where == 2 else [])
            e2 = tokens if where == 1 else (tokens[len(tokens) // 2:] if where == 2 else [])
            t1, t2 = base(extra1=e1, extra2=e2, n1=n1 + len(e1), n2=n2 + len(e2), shared=rep % 3)
            yield "transitions", t1, t2
    # every phrase of every category once, alone, in text 2
    for cat, phrases in TRANSITIONS.items():
        for ph in phrases:
            t1, t2 = base(extra2=ph.split(), n2=n2 + len(ph.split()))
            yield "transition_phrase", t1, t2
    # 6. raw-substring hits inside other words; arXiv: phrases spanning the text 1 + text 2 join.
    for _ in range(40):
        carriers = rng.sample(CARRIERS, rng.randint(1, 5))
        t1, t2 = base(extra2=carriers, n2=n2 + len(carriers))
        yield "substring_hit", t1, t2
    for ph in ["thus", "so", "as", "therefore", "then", "still", "however", "if", "yet", "in short", "after all"]:
        cut = max(1, len(ph) // 2)
        t1, t2 = base()
        yield "join_span", t1 + ph[:cut], ph[cut:] + t2
        yield "join_span", t1 + " " + ph[:cut], ph[cut:] + " " + t2
    # 7. contractions, non-ASCII, zero-width characters (vocabulary and Jaccard word rules).
    for _ in range(60):
        e1 = rng.sample(CONTRACTIONS + UNICODE_WORDS, rng.randint(0, 6))
        e2 = rng.sample(CONTRACTIONS + UNICODE_WORDS, rng.randint(1, 10))
        t1, t2 = base(extra1=e1, extra2=e2, n1=n1 + len(e1), n2=n2 + len(e2))
        yield "contractions_unicode", t1, t2
    for zw in NOT_WHITESPACE:
        t1, t2 = base()
        yield "zero_width", t1.replace(" ", zw, 3), t2.replace(" ", zw, 5)
    # 8. unusual whitespace: inner separators and leading/trailing runs (unstripped lengths).
    for _ in range(80):
        t1, t2 = base(ratio=rng.choice([lr[0], lr[1], lr[2], lr[3], mid_len]), d=rng.randint(-2, 2))
        ws = rng.choice(WHITESPACE)
        mode = rng.randrange(4)
        if mode == 0:
            t1 = ws + t1 + rng.choice(WHITESPACE)
        elif mode == 1:
            t2 = rng.choice(WHITESPACE) * rng.randint(1, 8) + t2 + ws
        elif mode == 2:
            t1, t2 = t1.replace(" ", ws), t2.replace(" ", rng.choice(WHITESPACE))
        else:
            t1, t2 = ws * 5 + t1, t2 + ws * rng.randint(5, 40)
        yield "whitespace", t1, t2
    # 9. empty, whitespace-only, punctuation-only, identical, stopword-only.
    salad1, salad2 = base()
    for a, b in [("", ""), ("", salad2), (salad1, ""), (" \n\t ", salad2), (salad1, "   "),
                 ("-- ... !! ?? ** ;; :: ,, .. !!", salad2), (salad1, "-- ... !! ?? ** ;; :: ,, .. !!"),
                 ("-- " * (lo_w + 2), "-- " * (lo_w * 2 + 2))]:
        yield "empty", a, b
    for _ in range(12):
        t1, _t2 = base()
        yield "identical", t1, t1
        s = sentence_text(rng, rng.randint(lo_w, min(hi_w, lo_w + 60)))
        yield "identical", s, s
    for _ in range(30):
        a_n = rng.randint(lo_w, lo_w + (40 if arxiv else 10))
        b_n = rng.randint(a_n, min(hi_w, a_n * (2 if arxiv else 3)))
        vocab1 = rng.sample(STOPWORDS, rng.randint(40, 90) if arxiv else rng.randint(4, 30))
        t1 = " ".join(rng.choice(vocab1) for _ in range(a_n))
        t2 = " ".join(rng.choice(STOPWORDS) for _ in range(b_n))
        if rng.random() < 0.5:  # every stopword once, then repeats
            t2 = " ".join((rng.sample(STOPWORDS, len(STOPWORDS)) * 3)[:b_n])
        yield "stopwords_only", t1, t2
    # 10. English-like pairs across the bands (most reach the style level).
    while True:
        if arxiv:
            a_n = rng.randint(lo_w - 3, hi_w + 3)
            b_n = rng.randint(int(a_n * 0.7), min(hi_w + 3, int(a_n * 1.9)))
        else:
            a_n = rng.randint(lo_w - 1, 40)
            b_n = rng.randint(a_n, a_n * 5)
        t1 = sentence_text(rng, a_n, rng.choice([0.0, 0.05, 0.15]), rng.choice([0.1, 0.35, 0.5]))
        t2 = sentence_text(rng, b_n, rng.choice([0.0, 0.05, 0.1, 0.3]), rng.choice([0.1, 0.35, 0.5]),
                           cats=rng.sample(cat_names, rng.randint(1, 12)))
        yield "english", t1, t2


def build(task: str, func: Callable, seed: int, n_english: int) -> tuple[list[dict], dict]:
    rng = random.Random(f"{seed}-{task}")
    rows, english = [], 0
    for kind, t1, t2 in cases(task, rng):
        if kind == "english":
            if english >= n_english and len(rows) >= MIN_PAIRS:
                break
            english += 1
        reward, reached = run_reference(func, t1, t2)
        rows.append({"kind": kind, "text1": t1, "text2": t2, "reward": reward, "reached": reached})
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    by_level = {lvl: sum(r["reached"] == lvl for r in rows) for lvl in (1, 2, 3, 4)}
    return rows, {"kinds": counts, "reached": by_level}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path, help="the reference repository checkout (with rewards/*.py)")
    ap.add_argument("--commit", help="the checkout's commit, when it is not a git work tree")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--english", type=int, default=400, help="English-like pairs per task (at least)")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    commit = args.commit or git_commit(args.checkout)
    if commit is None:
        sys.exit("cannot tell the reference commit: pass --commit")
    funcs = load_reference(args.checkout)
    args.out.mkdir(parents=True, exist_ok=True)
    for task, func in funcs.items():
        rows, stats = build(task, func, args.seed, args.english)
        meta = {"reference": "OpenMLRL/LLM_Collab_Writing", "commit": commit,
                "function": func.__name__, "seed": args.seed, "pairs": len(rows), **stats,
                "generator": "scripts/reference_fixtures/writing_rewards.py"}
        path = args.out / f"writing_reward_paper_{task}.jsonl.gz"
        with gzip.GzipFile(path, "wb", mtime=0) as gz:
            gz.write((json.dumps({"meta": meta}, ensure_ascii=False) + "\n").encode("utf-8"))
            for r in rows:
                gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
        print(f"{path}: {len(rows)} pairs, reached {stats['reached']}, kinds {stats['kinds']}")


if __name__ == "__main__":
    main()
