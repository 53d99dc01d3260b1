"""The prompt set of `stallfree bench agree-rate`: 120 varied prompts built in code (no download), tokenized by the
model file's own tokenizer.

Each of 30 subjects (science, history, cooking, code, arithmetic, other languages, dialogue...) gives four prompts in
rotating forms: a short plain completion, a short chat question, a medium paragraph (plain or chat) and a long
passage of ~120-300 tokens that strings the subject's sentences with those of the subjects after it, plain or chat.
Chat prompts go through the file's chat template (ChatML where it has none). The set depends on nothing but the
tokenizer, so two runs (and llama.cpp's side) see the same token ids.
"""
from __future__ import annotations

from dataclasses import dataclass

# (subject, a plain opening to continue, a question, sentences about it)
SUBJECTS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("the water cycle", "After the storm, rain falls on the hills and", "Why does the sea not overflow when rivers keep flowing into it?",
     ("Water evaporates from oceans and lakes when the sun warms them.", "The vapour cools as it rises and forms clouds.",
      "Clouds release the water again as rain or snow, which runs back to the sea.")),
    ("bicycle gears", "To climb a steep hill on a bicycle, you should", "How do the gears on a bicycle make climbing easier?",
     ("A small front chainring and a large rear sprocket give a low gear.", "In a low gear each pedal stroke turns the "
      "wheel less, so it takes less force.", "Riders shift to higher gears on flat roads to go faster.")),
    ("the Roman Empire", "The Roman Empire was founded when", "What were the main reasons the Western Roman Empire fell?",
     ("Augustus became the first Roman emperor in 27 BC.", "At its height the empire stretched from Britain to Egypt.",
      "Roads, aqueducts and a common law held its provinces together.")),
    ("baking bread", "The secret to a good loaf of bread is", "Why does bread dough need to rest before baking?",
     ("Yeast eats the sugars in flour and releases carbon dioxide.", "The gas is trapped by gluten, which makes the "
      "dough rise.", "Kneading develops the gluten and gives bread its chewy texture.")),
    ("Python lists", "def average(numbers):\n    \"\"\"Return the mean of a list of numbers.\"\"\"\n",
     "What is the difference between a list and a tuple in Python?",
     ("A Python list is mutable: items can be added, removed or replaced.", "Tuples are immutable and can be used as "
      "dictionary keys.", "List comprehensions such as [x * x for x in range(10)] build new lists concisely.")),
    ("photosynthesis", "Every green plant in the garden turns sunlight into", "Explain photosynthesis to a ten-year-old.",
     ("Leaves contain chlorophyll, a green pigment that absorbs light.", "Plants combine carbon dioxide and water into "
      "sugar, releasing oxygen.", "Almost all the food chains on land begin with this process.")),
    ("the French language", "Bonjour, je m'appelle Marie et j'habite", "How do you say 'good morning' in French?",
     ("French is spoken by about three hundred million people.", "Nouns in French are either masculine or feminine.",
      "La tour Eiffel se trouve à Paris, au bord de la Seine.")),
    ("prime numbers", "2, 3, 5, 7, 11, 13, 17,", "Is 91 a prime number? Show your reasoning.",
     ("A prime number has exactly two divisors, one and itself.", "Euclid proved that there are infinitely many "
      "primes.", "Every integer greater than one factors uniquely into primes.")),
    ("the Moon", "On the night of the full moon, the villagers", "Why do we always see the same side of the Moon?",
     ("The Moon orbits the Earth about once every 27 days.", "Its gravity raises the tides in the oceans.",
      "Twelve astronauts walked on its surface between 1969 and 1972.")),
    ("job interviews", "Interviewer: Tell me about yourself.\nCandidate:", "What should I wear to a job interview?",
     ("Preparing a few stories about past work helps answer questions clearly.", "Researching the company shows "
      "genuine interest.", "Sending a short thank-you note afterwards is a polite habit.")),
    ("volcanoes", "The volcano had been quiet for centuries until", "What causes a volcano to erupt?",
     ("Magma rises from deep inside the Earth through cracks in the crust.", "Pressure from gases in the magma can "
      "cause violent explosions.", "Volcanic ash makes the surrounding soil very fertile.")),
    ("SQL queries", "SELECT name, COUNT(*) AS orders\nFROM customers\nJOIN",
     "Write an SQL query that finds the ten most recent orders.",
     ("SQL reads data with SELECT and filters rows with WHERE.", "JOIN combines rows of two tables that share a key.",
      "An index on a column makes lookups on that column much faster.")),
    ("the human heart", "At rest, a healthy adult heart beats about", "How does the heart pump blood around the body?",
     ("The heart has four chambers: two atria and two ventricles.", "The right side pumps blood to the lungs to pick up "
      "oxygen.", "The left side sends oxygen-rich blood to the rest of the body.")),
    ("chess openings", "1. e4 e5 2. Nf3 Nc6 3.", "What is a good opening for a beginner in chess?",
     ("Controlling the centre of the board is the first aim of most openings.", "Knights and bishops should be "
      "developed before the queen.", "Castling early keeps the king safe.")),
    ("climate change", "Scientists agree that rising global temperatures are", "What can one person do to reduce their carbon footprint?",
     ("Burning coal, oil and gas releases carbon dioxide into the atmosphere.", "Carbon dioxide traps heat and warms the "
      "planet.", "Wind and solar power produce electricity without those emissions.")),
    ("Spanish cooking", "La paella es un plato típico de", "What ingredients go into a traditional Spanish paella?",
     ("Paella comes from the region of Valencia.", "Saffron gives the rice its golden colour.",
      "Tapas are small dishes shared with friends in the evening.")),
    ("compound interest", "If you invest 1000 dollars at 5 percent a year, after 10 years you will have",
     "Explain compound interest with an example.",
     ("Compound interest is earned on both the principal and the interest already added.", "The rule of 72 estimates how "
      "many years it takes money to double.", "Starting to save early matters more than saving large amounts later.")),
    ("the printing press", "Before the printing press, books were", "How did the printing press change Europe?",
     ("Johannes Gutenberg built a printing press with movable type around 1440.", "Printed books became cheaper and "
      "spread ideas quickly.", "Literacy rose as more people could afford to read.")),
    ("sleep", "Last night I could not sleep because", "How many hours of sleep does an adult need?",
     ("Most adults need seven to nine hours of sleep each night.", "During deep sleep the body repairs muscles and "
      "tissues.", "Screens before bed can delay the release of melatonin.")),
    ("JavaScript promises", "async function fetchUser(id) {\n  const response = await",
     "What is the difference between a promise and a callback in JavaScript?",
     ("A promise represents a value that will be available later.", "The then method runs code once the promise "
      "resolves.", "async and await let asynchronous code read like ordinary sequential code.")),
    ("honey bees", "The bees left the hive early in the morning to", "Why are bees important for farming?",
     ("A honey bee colony can hold tens of thousands of workers.", "Bees carry pollen from flower to flower as they "
      "collect nectar.", "Many fruits and vegetables depend on this pollination.")),
    ("the German language", "Ich habe gestern ein Buch gelesen, das", "Why are German words sometimes so long?",
     ("German forms long compound nouns by joining shorter words.", "Every German noun is written with a capital letter.",
      "Der Rhein fließt durch mehrere Länder bis zur Nordsee.")),
    ("electric circuits", "A simple circuit needs a battery, a wire and", "What is Ohm's law?",
     ("Current is the flow of electric charge through a conductor.", "Ohm's law says that voltage equals current times "
      "resistance.", "In a series circuit the same current flows through every component.")),
    ("a customer complaint", "Dear Sir or Madam,\nI am writing to complain about",
     "Write a polite email returning a broken kettle.",
     ("A good complaint states clearly what went wrong and when.", "Attaching a receipt helps the shop find the order.",
      "Asking for a specific remedy, such as a refund, speeds up the reply.")),
    ("black holes", "Nothing can escape a black hole, not even", "What happens at the event horizon of a black hole?",
     ("A black hole forms when a massive star collapses under its own gravity.", "Its event horizon marks the point of "
      "no return.", "In 2019 astronomers published the first image of a black hole's shadow.")),
    ("gardening", "In early spring, the first thing to plant in the garden is", "How often should I water tomato plants?",
     ("Tomatoes need at least six hours of sunlight a day.", "Compost adds nutrients and helps soil hold water.",
      "Mulch keeps weeds down and the roots cool in summer.")),
    ("sorting algorithms", "def quicksort(items):\n    if len(items) <= 1:\n        return items\n",
     "Which sorting algorithm is fastest on average, and why?",
     ("Quicksort picks a pivot and partitions the other items around it.", "Merge sort splits a list in halves and "
      "merges the sorted halves.", "Both run in O(n log n) time on average.")),
    ("the Olympic Games", "The first modern Olympic Games were held in", "Why are the Olympic Games held every four years?",
     ("The ancient Olympic Games began in Olympia in 776 BC.", "The modern games were revived in Athens in 1896.",
      "The five rings stand for the continents taking part.")),
    ("a travel itinerary", "Day 1: Arrive in Kyoto and", "Plan a three-day trip to Kyoto.",
     ("Kyoto was the capital of Japan for more than a thousand years.", "The city has over a thousand Buddhist "
      "temples.", "Early morning is the quietest time to visit the famous shrines.")),
    ("arithmetic", "Question: What is 17 times 23?\nAnswer:", "What is 144 divided by 12, plus 7?",
     ("Multiplication is repeated addition.", "Dividing by a fraction is the same as multiplying by its reciprocal.",
      "The order of operations puts multiplication before addition.")),
)

LONG_TARGETS = (120, 200, 280)  # tokens a long passage grows to (whole sentences: it may pass by one sentence)


@dataclass(frozen=True)
class Prompt:
    subject: str
    form: str  # short-plain | short-chat | medium-plain | medium-chat | long-plain | long-chat
    text: str  # what was tokenized (a chat prompt: after the template)
    tokens: tuple[int, ...]


def _chat(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def _long_passage(tokenizer, start: int, target: int, chat: bool) -> str:
    """The subject's sentences, then those of the subjects after it, until the prompt holds `target` tokens."""
    sentences = [s for k in range(len(SUBJECTS)) for s in SUBJECTS[(start + k) % len(SUBJECTS)][3]]
    body = ""
    for sentence in sentences:
        body = f"{body} {sentence}".strip()
        text = _chat(tokenizer, f"{body}\n\nSummarize the passage above in two sentences.") if chat else body
        if len(tokenizer.encode(text)) >= target:
            return text
    return text


def build_prompts(tokenizer) -> list[Prompt]:
    """4 prompts per subject, forms rotating with the subject's index so each form meets every kind of subject."""
    prompts = []
    for i, (subject, opening, question, sentences) in enumerate(SUBJECTS):
        for j in range(4):
            kind = (i + j) % 4  # 0 short, 1 short chat, 2 medium, 3 long
            # medium and long prompts are chat-templated on alternating subjects, independently of each other
            chat = (i % 2 == 1) if kind == 2 else (i // 2) % 2 == 0 if kind == 3 else kind == 1
            if kind == 0:
                text, form = opening, "short-plain"
            elif kind == 1:
                text, form = _chat(tokenizer, question), "short-chat"
            elif kind == 2:
                paragraph = " ".join(sentences)
                text = _chat(tokenizer, f"{paragraph}\n\n{question}") if chat else f"{paragraph} In other words,"
                form = "medium-chat" if chat else "medium-plain"
            else:
                text = _long_passage(tokenizer, i, LONG_TARGETS[(i + j) % len(LONG_TARGETS)], chat)
                form = "long-chat" if chat else "long-plain"
            prompts.append(Prompt(subject, form, text, tuple(tokenizer.encode(text))))
    return prompts
