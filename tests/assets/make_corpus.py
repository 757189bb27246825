"""Writes ``corpus/``: a small generated parallel corpus in Multi30k's layout, as plain UTF-8 text
(``<split>.<lang>`` for en, de and fr; splits train, val and test_2016_flickr), so that the fast tests
need no corpus outside the repository. The sentences come from a fixed grammar over a small word list
(word-for-word, seeded), plus made-up names that read the same in all three languages; they are not
Multi30k's.

Run ``python tests/assets/make_corpus.py`` to write it again: the output is the same byte for byte.
"""

from __future__ import annotations

import random
from pathlib import Path

SPLITS = {"train": 500, "val": 100, "test_2016_flickr": 100}
SEED = 30
# (en, de, fr) word for word; the grammar below puts them in one order for all three languages.
DETERMINERS = [("a", "ein", "un"), ("the", "der", "le"), ("one", "ein", "un"), ("this", "dieser", "ce")]
ADJECTIVES = [
    ("young", "junger", "jeune"), ("old", "alter", "vieux"), ("small", "kleiner", "petit"),
    ("tall", "großer", "grand"), ("happy", "fröhlicher", "heureux"), ("tired", "müder", "fatigué"),
    ("red", "roter", "rouge"), ("blue", "blauer", "bleu"), ("green", "grüner", "vert"),
    ("black", "schwarzer", "noir"), ("white", "weißer", "blanc"), ("brown", "brauner", "brun"),
]  # fmt: skip
NOUNS = [
    ("man", "Mann", "homme"), ("woman", "Frau", "femme"), ("child", "Kind", "enfant"),
    ("dog", "Hund", "chien"), ("cat", "Katze", "chat"), ("horse", "Pferd", "cheval"),
    ("boy", "Junge", "garçon"), ("girl", "Mädchen", "fille"), ("worker", "Arbeiter", "ouvrier"),
    ("street", "Straße", "rue"), ("park", "Park", "parc"), ("beach", "Strand", "plage"),
    ("house", "Haus", "maison"), ("table", "Tisch", "table"), ("car", "Auto", "voiture"),
    ("ball", "Ball", "ballon"), ("bicycle", "Fahrrad", "vélo"), ("river", "Fluss", "rivière"),
    ("mountain", "Berg", "montagne"), ("market", "Markt", "marché"), ("shop", "Laden", "magasin"),
    ("guitar", "Gitarre", "guitare"), ("hat", "Hut", "chapeau"), ("jacket", "Jacke", "veste"),
]  # fmt: skip
VERBS = [
    ("walks", "geht", "marche"), ("runs", "läuft", "court"), ("sits", "sitzt", "est assis"),
    ("stands", "steht", "se tient"), ("plays", "spielt", "joue"), ("waits", "wartet", "attend"),
    ("looks", "schaut", "regarde"), ("works", "arbeitet", "travaille"), ("jumps", "springt", "saute"),
    ("sleeps", "schläft", "dort"), ("sings", "singt", "chante"), ("rides", "fährt", "roule"),
]  # fmt: skip
PREPOSITIONS = [
    ("in", "in", "dans"), ("on", "auf", "sur"), ("near", "nahe", "près de"), ("behind", "hinter", "derrière"),
    ("under", "unter", "sous"), ("with", "mit", "avec"), ("beside", "neben", "à côté de"),
]  # fmt: skip
SYLLABLES = ["ka", "lo", "mi", "ren", "tu", "sa", "vel", "dor", "ni", "qua", "bri", "zen", "ol", "fa", "ter"]


def name(rng: random.Random) -> tuple[str, str, str]:
    """A made-up name, the same in every language."""
    word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()
    return word, word, word


def phrase(rng: random.Random) -> list[tuple[str, str, str]]:
    """A noun phrase: a determiner, up to two adjectives and a noun, or a name."""
    if rng.random() < 0.25:
        return [name(rng)]
    return [rng.choice(DETERMINERS), *rng.sample(ADJECTIVES, rng.randint(0, 2)), rng.choice(NOUNS)]


def sentence(rng: random.Random) -> list[str]:
    """One sentence in en, de and fr: subject, verb, one or two prepositional phrases, a full stop."""
    words = [*phrase(rng), rng.choice(VERBS)]
    for _ in range(rng.randint(1, 2)):
        words += [rng.choice(PREPOSITIONS), *phrase(rng)]
    first = [word[0].upper() + word[1:] for word in words[0]]
    words[0] = (first[0], first[1], first[2])
    return [" ".join(word[lang] for word in words) + " ." for lang in range(3)]


def main() -> None:
    rng = random.Random(SEED)
    folder = Path(__file__).resolve().parent / "corpus"
    folder.mkdir(exist_ok=True)
    for split, size in SPLITS.items():
        rows = [sentence(rng) for _ in range(size)]
        for index, lang in enumerate(("en", "de", "fr")):
            (folder / f"{split}.{lang}").write_text("".join(row[index] + "\n" for row in rows), encoding="utf-8")


if __name__ == "__main__":
    main()
