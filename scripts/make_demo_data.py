"""Generate yeto's demo dataset: a few hundred chat records answered in pirate speak.

Facts (countries, capitals, continents) are public knowledge; the phrasing is
made here from templates, so the file is ours to redistribute (CC0). The style
is distinctive enough that a few minutes of CPU LoRA training on SmolLM2-135M
visibly changes the answers ("The capital of France is Paris." ->
"Arr matey, the capital o' France be Paris!") and lowers the held-out loss.

    python scripts/make_demo_data.py            # writes yeto/data/demo/pirate_chat.jsonl (data/demo links to it)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COUNTRIES = [
    ("France", "Paris", "Europe"), ("Germany", "Berlin", "Europe"), ("Italy", "Rome", "Europe"),
    ("Spain", "Madrid", "Europe"), ("Portugal", "Lisbon", "Europe"), ("United Kingdom", "London", "Europe"),
    ("Ireland", "Dublin", "Europe"), ("Netherlands", "Amsterdam", "Europe"), ("Belgium", "Brussels", "Europe"),
    ("Switzerland", "Bern", "Europe"), ("Austria", "Vienna", "Europe"), ("Poland", "Warsaw", "Europe"),
    ("Czech Republic", "Prague", "Europe"), ("Hungary", "Budapest", "Europe"), ("Greece", "Athens", "Europe"),
    ("Sweden", "Stockholm", "Europe"), ("Norway", "Oslo", "Europe"), ("Denmark", "Copenhagen", "Europe"),
    ("Finland", "Helsinki", "Europe"), ("Iceland", "Reykjavik", "Europe"), ("Romania", "Bucharest", "Europe"),
    ("Bulgaria", "Sofia", "Europe"), ("Serbia", "Belgrade", "Europe"), ("Croatia", "Zagreb", "Europe"),
    ("Ukraine", "Kyiv", "Europe"), ("Estonia", "Tallinn", "Europe"), ("Latvia", "Riga", "Europe"),
    ("Lithuania", "Vilnius", "Europe"), ("Slovakia", "Bratislava", "Europe"), ("Slovenia", "Ljubljana", "Europe"),
    ("Japan", "Tokyo", "Asia"), ("China", "Beijing", "Asia"), ("India", "New Delhi", "Asia"),
    ("South Korea", "Seoul", "Asia"), ("Thailand", "Bangkok", "Asia"), ("Vietnam", "Hanoi", "Asia"),
    ("Indonesia", "Jakarta", "Asia"), ("Philippines", "Manila", "Asia"), ("Malaysia", "Kuala Lumpur", "Asia"),
    ("Pakistan", "Islamabad", "Asia"), ("Bangladesh", "Dhaka", "Asia"), ("Nepal", "Kathmandu", "Asia"),
    ("Sri Lanka", "Colombo", "Asia"), ("Mongolia", "Ulaanbaatar", "Asia"), ("Iran", "Tehran", "Asia"),
    ("Iraq", "Baghdad", "Asia"), ("Saudi Arabia", "Riyadh", "Asia"), ("Israel", "Jerusalem", "Asia"),
    ("Jordan", "Amman", "Asia"), ("Turkey", "Ankara", "Asia"), ("Afghanistan", "Kabul", "Asia"),
    ("Kazakhstan", "Astana", "Asia"), ("Singapore", "Singapore", "Asia"), ("Qatar", "Doha", "Asia"),
    ("Egypt", "Cairo", "Africa"), ("Nigeria", "Abuja", "Africa"), ("Kenya", "Nairobi", "Africa"),
    ("Ethiopia", "Addis Ababa", "Africa"), ("Ghana", "Accra", "Africa"), ("Morocco", "Rabat", "Africa"),
    ("Algeria", "Algiers", "Africa"), ("Tunisia", "Tunis", "Africa"), ("Senegal", "Dakar", "Africa"),
    ("Uganda", "Kampala", "Africa"), ("Tanzania", "Dodoma", "Africa"), ("Zimbabwe", "Harare", "Africa"),
    ("Zambia", "Lusaka", "Africa"), ("Angola", "Luanda", "Africa"), ("Mali", "Bamako", "Africa"),
    ("Sudan", "Khartoum", "Africa"), ("Rwanda", "Kigali", "Africa"), ("Madagascar", "Antananarivo", "Africa"),
    ("Canada", "Ottawa", "North America"), ("United States", "Washington, D.C.", "North America"),
    ("Mexico", "Mexico City", "North America"), ("Cuba", "Havana", "North America"),
    ("Jamaica", "Kingston", "North America"), ("Guatemala", "Guatemala City", "North America"),
    ("Panama", "Panama City", "North America"), ("Costa Rica", "San Jose", "North America"),
    ("Honduras", "Tegucigalpa", "North America"), ("Nicaragua", "Managua", "North America"),
    ("Brazil", "Brasilia", "South America"), ("Argentina", "Buenos Aires", "South America"),
    ("Chile", "Santiago", "South America"), ("Peru", "Lima", "South America"),
    ("Colombia", "Bogota", "South America"), ("Venezuela", "Caracas", "South America"),
    ("Ecuador", "Quito", "South America"), ("Uruguay", "Montevideo", "South America"),
    ("Paraguay", "Asuncion", "South America"), ("Bolivia", "Sucre", "South America"),
    ("Australia", "Canberra", "Oceania"), ("New Zealand", "Wellington", "Oceania"),
    ("Fiji", "Suva", "Oceania"), ("Papua New Guinea", "Port Moresby", "Oceania"), ("Samoa", "Apia", "Oceania"),
]

OPENERS = ["Arr, matey!", "Ahoy!", "Arr!", "Yo ho ho!", "Shiver me timbers!", "Avast, me hearty!", "Aye aye!"]
CLOSERS = ["savvy?", "me hearty!", "matey!", "arr!", "by the briny deep!", "yo ho!"]

QUESTIONS = {
    "capital": ["What is the capital of {c}?", "What's the capital city of {c}?", "Which city is the capital of {c}?"],
    "continent": ["Which continent is {c} in?", "On what continent is {c}?"],
    "city": ["Tell me about {k}.", "What country is {k} the capital of?"],
}
ANSWERS = {
    "capital": ["{o} The capital o' {c} be {k}, {e}", "{o} {k} be the capital o' {c}, {e}", "{o} Ye be seekin' {k}, the capital o' {c}, {e}"],
    "continent": ["{o} {c} be lyin' in {n}, {e}", "{o} Ye'll find {c} in {n}, {e}"],
    "city": ["{o} {k} be the capital o' {c}, a fine port in {n}, {e}", "{o} That be {k}, capital o' {c} in {n}, {e}"],
}
GENERAL = [
    ("Hello! Who are you?", "Ahoy, matey! I be a pirate o' the seven seas, ready to answer yer questions, arr!"),
    ("How are you today?", "Arr, I be finer than a chest o' gold doubloons, me hearty!"),
    ("What is 2 + 2?", "Arr, two plus two be four, as sure as the tide, matey!"),
    ("What color is the sky?", "Arr, the sky be blue as the open sea on a calm day, savvy?"),
    ("Can you help me?", "Aye aye, matey! Ask away, and this old sea dog will do his best, arr!"),
    ("What is the largest ocean?", "Shiver me timbers! The Pacific be the biggest ocean o' them all, matey!"),
    ("Thank you!", "Yer welcome, me hearty! Fair winds to ye, arr!"),
    ("Goodbye!", "Fair winds and followin' seas, matey! Arr!"),
]


def make_records(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for c, k, n in COUNTRIES:
        for kind in ("capital", "continent", "city"):
            q = rng.choice(QUESTIONS[kind]).format(c=c, k=k, n=n)
            a = rng.choice(ANSWERS[kind]).format(o=rng.choice(OPENERS), e=rng.choice(CLOSERS), c=c, k=k, n=n)
            records.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    for q, a in GENERAL:
        records.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    rng.shuffle(records)
    return records


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "yeto" / "data" / "demo" / "pirate_chat.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    recs = make_records()
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    print(f"wrote {len(recs)} records to {out}")


if __name__ == "__main__":
    main()
