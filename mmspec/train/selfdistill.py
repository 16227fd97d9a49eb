"""Self-distillation data for trained drafters: what the target itself says, with its features.

Two sources, both token sequences with a mask of the positions to learn:
- ``text``: instructions the project writes (templates x topics, disjoint from ``mmspec bench``'s
  prompts), answered by the real SmolLM2 itself with greedy decoding (batched transformers
  ``generate``), so a drafter learns the target's own continuations;
- ``caption``: the caption data's train split (image + prompt), answered by the captioner itself
  (greedy) and teacher-forced through it.

``extract_features`` runs the target once over each sequence (teacher forcing) and keeps its last
hidden states (the LM head's input) in bf16, in chunks on disk, so drafter training never reruns
the 30-layer target. The hidden state after the first ``SHALLOW_LAYER`` layers is kept too (the
early exit of Kangaroo-style drafters).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

#: decoder layers whose output is stored as the "shallow" feature (Kangaroo's early exit)
SHALLOW_LAYER = 2

TEMPLATES = [
    "Write a short paragraph about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Give three facts about {topic}.",
    "What are the advantages and disadvantages of {topic}?",
    "Write a short story that involves {topic}.",
    "Describe {topic} in two sentences.",
    "How would you teach someone about {topic}?",
    "Write a friendly email to a colleague about {topic}.",
    "List five words related to {topic} and explain each briefly.",
    "Summarize the history of {topic} briefly.",
    "Rewrite this sentence in a formal style: I really like {topic} because it is fun.",
    "Translate into simple English: The phenomenon of {topic} is frequently misunderstood.",
    "Answer briefly: why is {topic} important?",
    "Write a haiku about {topic}.",
    "Compare {topic} with something similar.",
    "What questions do people often ask about {topic}? Answer two of them.",
    "If you had 10 dollars and spent 3 on {topic}, how much would be left? Explain.",
    "Describe a picture that shows {topic}.",
]
TOPICS = [
    "the ocean", "volcanoes", "bicycles", "coffee", "the moon", "rain forests", "chess", "bread baking",
    "honey bees", "trains", "the internet", "recycling", "gardening", "the piano", "dinosaurs", "winter",
    "football", "libraries", "clocks", "bridges", "solar power", "birds", "mountains", "cheese",
    "the human heart", "photography", "paper", "maps", "rivers", "robots", "tea", "castles", "deserts",
    "electricity", "friendship", "music festivals", "umbrellas", "glass", "the alphabet", "pyramids",
    "airplanes", "vaccines", "cats", "dogs", "markets", "fishing", "origami", "the weather", "stars",
    "painting", "swimming", "recipes", "money", "newspapers", "insects", "cars", "batteries", "tides",
]


NAMES = ["Maria", "Omar", "Lena", "Kenji", "Ada", "Tomas", "Priya", "Sam", "Ines", "Felix", "Nora", "Yusuf"]
PLACES = ["the old harbour", "a small village", "the city centre", "a mountain hut", "the train station",
          "a school library", "the market square", "a seaside town", "the museum", "a farm near the river"]
OBJECTS = ["a red umbrella", "two blue cups", "a wooden box", "an old radio", "a green lamp", "three books",
           "a silver bicycle", "a striped scarf", "a paper map", "a basket of apples", "a brass key", "a white kite"]
ACTIONS = ["opened a new bakery", "repaired the bridge", "planted forty trees", "started a chess club",
           "painted the town hall", "organised a music festival", "built a solar-powered bus stop",
           "collected old phones for recycling", "wrote a guide to local birds", "cleaned the river banks"]
MONTHS = ["January", "March", "April", "June", "August", "October", "November"]


def make_passage(rng: random.Random) -> str:
    """A short news-like passage of four to six sentences with names, places, numbers and months."""
    name, other = rng.sample(NAMES, 2)
    place, action, month = rng.choice(PLACES), rng.choice(ACTIONS), rng.choice(MONTHS)
    sentences = [
        f"In {month}, {name} and a group of volunteers {action} in {place}.",
        f"The work took {rng.randint(2, 12)} weeks and cost about {rng.randint(2, 90) * 100} dollars.",
        f"{other}, who helped from the start, said that the hardest part was {rng.choice(['the weather', 'finding money', 'the paperwork', 'carrying the tools'])}.",
        f"About {rng.randint(20, 400)} people came to see the result on the first day.",
        f"Next year the group wants to work on {rng.choice(TOPICS)} as well.",
        f"Local children brought {rng.choice(OBJECTS)} and {rng.choice(OBJECTS)} to the opening.",
    ]
    return " ".join(sentences[: rng.randint(4, 6)])


def task_prompt(rng: random.Random) -> str:
    """An instruction of the kinds users send (summaries, rewrites, context QA, arithmetic, chat,
    scenes), built from random parts; no text shared with ``mmspec bench text``'s prompts."""
    kind = rng.randrange(7)
    passage = make_passage(rng)
    name = rng.choice(NAMES)
    if kind == 0:
        return f"{passage}\n\n{rng.choice(['Summarize the text above in one sentence.', 'Give a short summary of this text.', 'What is this text about? Answer briefly.'])}"
    if kind == 1:
        style = rng.choice(["in the future tense", "in a formal style", "as a short poem", "exactly, word for word", "for a young child", "in the first person"])
        return f"Rewrite the following text {style}:\n\n{passage}"
    if kind == 2:
        question = rng.choice(["who did the work, and where?", "how long did the work take?", "how much did it cost?",
                               "how many people came on the first day?", "what does the group want to do next year?"])
        return f"Context: {passage}\n\nBased on the context, answer: {question}"
    if kind == 3:
        a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(2, 9)
        return rng.choice([
            f"{name} buys {b} notebooks at {a} cents each and pays with {a * b + c * 10} cents. How much change does {name} get? Explain step by step.",
            f"A train travels {a * c} kilometres in {c} hours. What is its average speed? Show your work.",
            f"{name} has {a * b} stickers and shares them equally among {b} friends. How many does each friend get?",
            f"What is {a} times {b} plus {c}? Explain each step.",
        ])
    if kind == 4:
        return rng.choice([
            f"Hello! My friend {name} is visiting {rng.choice(PLACES)} next week. Any tips?",
            f"I want to learn about {rng.choice(TOPICS)} but I only have ten minutes a day. How should I start?",
            f"Can you help me plan a birthday party for {name}? She likes {rng.choice(TOPICS)}.",
            "I feel tired every afternoon at work. What small changes could help?",
        ])
    if kind == 5:
        objects = rng.sample(OBJECTS, rng.randint(2, 4))
        return f"Describe a picture of {rng.choice(PLACES)} that contains {', '.join(objects)}."
    return rng.choice(TEMPLATES).format(topic=rng.choice(TOPICS))


def text_prompts(count: int, seed: int = 0, prompt_set: str = "templates") -> list[str]:
    """``count`` instructions: ``templates`` (template x topic) or ``tasks`` (:func:`task_prompt`)."""
    rng = random.Random(seed)
    if prompt_set == "tasks":
        return [task_prompt(rng) for _ in range(count)]
    if prompt_set != "templates":
        raise ValueError(f"unknown prompt set {prompt_set!r}; choose 'templates' or 'tasks'")
    return [rng.choice(TEMPLATES).format(topic=rng.choice(TOPICS)) for _ in range(count)]


def generate_text_sequences(model, tokenizer, prompts: list[str], max_new_tokens: int = 128, batch_size: int = 16):
    """Greedy answers of ``model`` -> list of (ids [L] LongTensor, learn mask [L] bool: the answer)."""
    tokenizer.padding_side = "left"
    sequences = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in chunk]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        for row in range(len(chunk)):
            prompt = batch["input_ids"][row][batch["attention_mask"][row].bool()]
            answer = out[row, batch["input_ids"].shape[1]:]
            answer = answer[answer != tokenizer.pad_token_id]
            ids = torch.cat([prompt, answer])
            learn = torch.zeros(len(ids), dtype=torch.bool)
            learn[len(prompt):] = True
            sequences.append((ids, learn))
    return sequences


def extract_text_features(model, sequences) -> list[dict[str, torch.Tensor]]:
    """Teacher-forced target features: [{"ids" [L], "learn" [L], "features" [L, H] bf16}]."""
    records = []
    with torch.inference_mode():
        for ids, learn in sequences:
            out = model.model(input_ids=ids[None], output_hidden_states=True)
            records.append({"ids": ids, "learn": learn, "features": out.last_hidden_state[0].to(torch.bfloat16),
                            "shallow": out.hidden_states[SHALLOW_LAYER][0].to(torch.bfloat16)})
    return records


def extract_caption_features(model, processor, samples) -> list[dict[str, torch.Tensor]]:
    """Caption samples (image, prompt, answer) teacher-forced through the captioner."""
    from .captioner import IGNORE, build_batch

    records = []
    with torch.inference_mode():
        for sample in samples:
            batch = build_batch(processor, [sample])
            out = model.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                pixel_values=batch["pixel_values"].to(model.dtype), pixel_attention_mask=batch["pixel_attention_mask"],
                output_hidden_states=True,
            )
            records.append({"ids": batch["input_ids"][0], "learn": batch["labels"][0] != IGNORE,
                            "features": out.last_hidden_state[0].to(torch.bfloat16),
                            "shallow": out.hidden_states[SHALLOW_LAYER][0].to(torch.bfloat16)})
    return records


def save_chunk(directory: Path, index: int, records) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"chunk-{index:04d}.tmp"
    torch.save(records, tmp)
    tmp.replace(directory / f"chunk-{index:04d}.pt")


def load_chunks(directory: Path) -> list[dict[str, torch.Tensor]]:
    """The self-distilled records of ``directory``'s ``chunk-*.pt`` files, in order. Raises
    FileNotFoundError (one line) when it holds none."""
    paths = sorted(directory.glob("chunk-*.pt"))
    if not paths:
        raise FileNotFoundError(f"{directory} holds no self-distillation chunks (chunk-*.pt); give a folder that "
                                "mmspec train drafter or caption-data made")
    records = []
    for path in paths:
        records += torch.load(path, weights_only=True)
    return records
