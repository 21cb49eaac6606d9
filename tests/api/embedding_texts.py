"""Texts of the embedding tests: random sentences from a small vocabulary, and a text longer
than all-MiniLM-L6-v2's 256 tokens."""

from __future__ import annotations

import random

_VOCABULARY = """
the a of river mountain quickly slowly bright dark engine server queue token vector model
garden window paper music teacher student ocean storm coffee morning evening city forest
bicycle library painting kitchen market history science planet winter summer letter bridge
castle travel language friend computer battery signal memory question answer story yellow
green silent loud ancient modern tiny enormous gentle careful happy tired runs reads
builds sings writes opens carries watches remembers forgets
"""
WORDS = _VOCABULARY.split()  # the words random texts are made of

LONG_TEXT = (
    "The river rose slowly through the night, and by morning the low fields along its banks had "
    "become a wide, quiet lake. Farmers stood at the edges of their flooded land and talked about "
    "the spring of their childhood, when the water had reached the church steps and the baker had "
    "rowed his bread from door to door. The older ones said this flood was smaller; the younger "
    "ones were not so sure. Children floated paper boats between the fence posts while their "
    "parents carried furniture up narrow stairs, stacked sandbags against cellar doors and moved "
    "the animals to the hill behind the old mill. In the afternoon the sun came out, the wind "
    "dropped, and the whole valley shone like a mirror under a pale sky. Nobody knew how long the "
    "water would stay, but the radio promised dry weather for a week, and the mood in the village "
    "turned from worry to a strange, patient cheerfulness. That evening the tavern was full. "
    "People shared stories of earlier floods, argued about dams and drainage, and made plans to "
    "help the families whose houses stood lowest. Someone played an accordion, someone else sang, "
    "and for a few hours the rising water felt less like a disaster than an unexpected holiday "
    "that the whole valley had decided to spend together, waiting for the river to go home. "
    "Late at night, when the music stopped, the water was still there, black and calm, holding "
    "the stars and the lights of the houses on the hill."
)


def make_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 24))]
        text = " ".join(words).capitalize() + rng.choice([".", "!", "?", ""])
        if text not in out:
            out.append(text)
    return out
