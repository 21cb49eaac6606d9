"""The workloads of speculative decoding's benchmarks (``bench/speculative.py``, ``llmq bench
--workload``): chats written for what users do that copy from their input (rewrite a function
that is in the prompt, quote a document's sentences that answer a question, extract a text's
fields as JSON, continue a chat that quotes itself) and free writing, which copies nothing.
Each has four variants of its question; a prompt is 250-450 tokens on SmolLM2's template."""

from __future__ import annotations

CODE = '''def summarize_orders(orders, tax_rate=0.2):
    """Total the orders per customer, with tax, skipping cancelled ones."""
    totals = {}
    for order in orders:
        if order.get("status") == "cancelled":
            continue
        customer = order["customer"]
        amount = order["quantity"] * order["unit_price"]
        amount = amount * (1 + tax_rate)
        totals[customer] = totals.get(customer, 0) + amount
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    report = []
    for customer, total in ranked:
        line = f"{customer}: {total:.2f}"
        report.append(line)
    return "\\n".join(report)


def load_orders(path):
    """Read the orders of a JSON lines file, one order per line."""
    orders = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            orders.append(json.loads(line))
    return orders
'''
CODE_ASKS = [
    "Rewrite summarize_orders so that tax_rate defaults to 0.1. Give the whole code.",
    "Rename the variable totals to per_customer in summarize_orders. Give the whole code.",
    "Add a docstring line to load_orders saying it skips blank lines. Give the whole code.",
    "Make load_orders take an encoding argument. Give the whole code.",
]
QA_ASKS = [
    "Quote the sentences of the text that describe Holmes's rooms.",
    "Quote the sentences that say how Watson came to pass by Baker Street.",
    "Quote exactly the sentences about Irene Adler.",
    "Quote the sentences that tell what Holmes had been doing lately.",
]
JSON_TEXT = (
    "Order 4471 was placed on 12 March 2024 by Maria Gonzalez (maria.gonzalez@example.com, "
    "+34 612 555 019) for delivery to Calle Mayor 14, 28013 Madrid, Spain. She bought two "
    "Aeropress coffee makers at 39.90 EUR each and one bag of Ethiopia Yirgacheffe beans, "
    "250 g, at 14.50 EUR. Payment was by Visa ending 4242; the order shipped with DHL "
    "Express, tracking number JD014600006281, on 13 March 2024. Ticket 99812 notes that "
    "the customer asked for a gift wrap and an invoice in the name of Gonzalez Design SL, "
    "VAT number ESB12345678. Support agent Tom Becker closed the ticket on 15 March 2024."
)
JSON_ASKS = [
    "Extract the order id, customer name, email, phone and city as JSON.",
    "Extract every product with its quantity and unit price as a JSON list.",
    "Extract the payment card, carrier, tracking number and ship date as JSON.",
    "Extract the ticket number, agent, invoice name and VAT number as JSON.",
]
CHAT = [
    ("user", "I am planning a three day trip to Lisbon in May. What should I see?"),
    (
        "assistant",
        "Day 1: Walk through Alfama, visit the Sao Jorge Castle and watch the sunset from the "
        "Miradouro da Senhora do Monte. Day 2: Take tram 28 to Belem, see the Jeronimos "
        "Monastery, the Belem Tower and eat a pastel de nata at Pasteis de Belem. Day 3: Go to "
        "Sintra by train, visit the Pena Palace and the Quinta da Regaleira, and return for "
        "dinner in Bairro Alto.",
    ),
    ("user", "Great. Can you repeat the plan but move Sintra to day 1?"),
    (
        "assistant",
        "Day 1: Go to Sintra by train, visit the Pena Palace and the Quinta da Regaleira, and "
        "return for dinner in Bairro Alto. Day 2: Walk through Alfama, visit the Sao Jorge "
        "Castle and watch the sunset from the Miradouro da Senhora do Monte. Day 3: Take tram "
        "28 to Belem, see the Jeronimos Monastery, the Belem Tower and eat a pastel de nata at "
        "Pasteis de Belem.",
    ),
]
CHAT_ASKS = [
    "Now repeat the plan once more, with Belem on day 1.",
    "Repeat the plan as a list, with Alfama on day 3.",
    "Repeat the last plan word for word, then add one restaurant per day.",
    "Repeat the first plan and say which day is the most tiring.",
]
FREE_ASKS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a poem about autumn in a big city.",
    "Write a letter from a cat to its owner about the new dog.",
    "Write an essay on why people like to travel.",
]
# The opening of Conan Doyle's "A Scandal in Bohemia" (public domain), cut at 1800 characters.
DOCUMENT = (
    "To Sherlock Holmes she is always the woman. I have seldom heard him mention her under "
    "any other name. In his eyes she eclipses and predominates the whole of her sex. It was "
    "not that he felt any emotion akin to love for Irene Adler. All emotions, and that one "
    "particularly, were abhorrent to his cold, precise but admirably balanced mind. He was, "
    "I take it, the most perfect reasoning and observing machine that the world has seen, "
    "but as a lover he would have placed himself in a false position. He never spoke of the "
    "softer passions, save with a gibe and a sneer. They were admirable things for the "
    "observer, excellent for drawing the veil from men's motives and actions. But for the "
    "trained reasoner to admit such intrusions into his own delicate and finely adjusted "
    "temperament was to introduce a distracting factor which might throw a doubt upon all "
    "his mental results. Grit in a sensitive instrument, or a crack in one of his own "
    "high-power lenses, would not be more disturbing than a strong emotion in a nature such "
    "as his. And yet there was but one woman to him, and that woman was the late Irene "
    "Adler, of dubious and questionable memory.\n\n"
    "I had seen little of Holmes lately. My marriage had drifted us away from each other. "
    "My own complete happiness, and the home-centred interests which rise up around the man "
    "who first finds himself master of his own establishment, were sufficient to absorb all "
    "my attention, while Holmes, who loathed every form of society with his whole Bohemian "
    "soul, remained in our lodgings in Baker Street, buried among his old books, and "
    "alternating from week to week between cocaine and ambition, the drowsiness of the "
    "drug, and the fierce energy of his own keen nature. He was still, as ever, deeply "
    "attracted by the study of crime, and occupied his immense facul"
)


def workload_chats() -> dict[str, tuple[str, list[list[dict[str, str]]]]]:
    """Per workload's name (as ``--workload`` takes it), its title and its four chats."""

    def chats(asks: list[str], text: str = "", turns=()) -> list[list[dict[str, str]]]:
        head = [{"role": r, "content": c} for r, c in turns]
        return [head + [{"role": "user", "content": f"{text}{a}"}] for a in asks]

    return {
        "code-edit": ("code edit", chats(CODE_ASKS, f"```python\n{CODE}```\n\n")),
        "document-qa": ("document QA (quotes)", chats(QA_ASKS, f"{DOCUMENT}\n\n")),
        "json-extraction": ("JSON extraction", chats(JSON_ASKS, f"{JSON_TEXT}\n\n")),
        "multi-turn-chat": ("multi-turn chat", chats(CHAT_ASKS, turns=CHAT)),
        "free-writing": ("free writing", chats(FREE_ASKS)),
    }
