"""The open-domain text of the embedded voice: everyday English sentences from several sources
with different styles, so that a voice trained on their speech can say the sentences people type.

Sources (registered in :data:`SOURCES`, each a function ``(split) -> list[str]``):

- ``smollm2``: short sentences the real SmolLM2-135M-Instruct wrote on ~130 topics in six styles
  (statement, question, instruction, exclamation, news, dialogue), sampled, first sentence kept,
  filtered for length and characters, deduplicated (:func:`generate_smollm2`, ``mmspec train
  open-text --package``). The generated text is kept in ``open_text_smollm2.txt`` next to this module, so the
  data does not depend on the machine that generated it.
- ``smollm2-more``: more of the same generator's sentences, written with other seeds
  (``open_text_smollm2-seed*.txt``, ``mmspec train open-text --seed N --package``), less those of ``smollm2``;
  a source of its own so that ``smollm2``'s sentences, and the shards synthesised from them, stay
  as they were.
- ``fortunes``: quotations, jokes and riddles of Debian's ``fortunes-min``
  (``/usr/share/games/fortunes``), split into sentences.
- ``words``: sentences around words of Debian's ``wamerican`` word list (``/usr/share/dict``), for
  words and sound sequences the other sources miss.

  These two read system files: asking for either on a machine without its package is one
  MissingDependencyError line (:func:`check_sources`), never a corpus silently without it.
- ``numbers``: templates for what the text normaliser handles (numbers, ordinals, years, dates,
  times, currency, percentages, abbreviations, names, questions and exclamations).
- ``grammar``: the voice's original small world (:mod:`.sentences`), so it keeps what it could say.

Every sentence belongs to one split by a hash of its lower-cased text
(:func:`~mmspec.train.data.core.split_of` on ``"open|" + text.lower()``): a sentence owned by
``test`` is never synthesised for ``train``. The voice's held-out measurement uses the hand-written
sentences of :func:`~mmspec.train.data.held_out.test_sentences` instead, which no source
generated; every source drops those (:func:`~mmspec.train.data.held_out.is_held_out`) all the same.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .core import check_split, sample_rng, split_of, stable_hash
from .held_out import is_held_out
from .sentences import sentence as grammar_sentence

HERE = Path(__file__).parent
SMOLLM2_TEXT = HERE / "open_text_smollm2.txt"
FORTUNES = Path("/usr/share/games/fortunes")
WORDS = Path("/usr/share/dict/american-english")

#: characters a kept sentence may contain (the normaliser and the phonemizer say all of them)
ALLOWED = re.compile(r"^[A-Za-z0-9 ,.'?!;:$%&\-]+$")
MIN_WORDS, MAX_WORDS = 3, 28

TOPICS = (
    "cooking dinner", "a train journey", "a visit to the dentist", "buying shoes", "a football match",
    "gardening", "a birthday party", "the library", "a rainy afternoon", "learning to drive",
    "a job interview", "moving house", "a lost cat", "the supermarket", "a wedding", "a doctor's visit",
    "school homework", "a summer holiday", "the beach", "a mountain hike", "a broken phone",
    "the weather forecast", "a new neighbour", "breakfast", "coffee", "a late bus", "a museum",
    "a concert", "a video game", "a science lesson", "a history book", "the news", "an election",
    "a hospital", "a fire station", "a bakery", "a farm", "a zoo", "a city park", "a bicycle",
    "a car repair", "an airport", "a hotel", "a restaurant", "a picnic", "a thunderstorm", "winter",
    "spring flowers", "autumn leaves", "a camping trip", "fishing", "swimming lessons", "a marathon",
    "yoga", "a gym", "a diet", "a recipe", "baking bread", "a wedding cake", "a phone call",
    "an email", "a meeting at work", "a deadline", "a computer problem", "the internet", "a password",
    "a bank account", "saving money", "paying rent", "a tax form", "a shopping list", "a gift",
    "a letter from a friend", "a family dinner", "grandparents", "a new baby", "a pet dog",
    "a horse", "birds in the garden", "the ocean", "a river", "a forest", "the moon", "the stars",
    "a rocket launch", "a robot", "a smartphone app", "a movie", "a television show", "a novel",
    "a poem", "a painting", "music practice", "a piano", "a guitar", "dancing", "a theatre play",
    "a school trip", "a university lecture", "an exam", "a teacher", "a police officer", "a lawyer",
    "a nurse", "a farmer", "a chef", "a pilot", "a taxi driver", "a construction site", "a bridge",
    "traffic", "a parking ticket", "a map", "directions to the station", "a lost wallet", "an umbrella",
    "a cold", "sleep", "a dream", "a morning routine", "cleaning the kitchen", "laundry", "a leaking tap",
    "an electricity bill", "a power cut", "a holiday in Spain", "a trip to Japan", "New York",
    "London", "a small village", "a festival", "a football team", "tennis", "basketball", "chess",
    "a board game", "a puzzle", "an old photograph", "a clock", "a calendar", "a newspaper",
    "recycling", "climate", "a volcano", "an earthquake", "a snowstorm", "a library card",
)

STYLES = (
    "Write one short sentence someone might say about {topic}.",
    "Ask one short question about {topic}.",
    "Give one short instruction about {topic}.",
    "Write one short exclamation about {topic}.",
    "Write one short sentence from a news report about {topic}.",
    "Write one short line of dialogue about {topic}.",
)

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"\u201d]?\s+")
_ABBREVIATIONS = ("mr.", "mrs.", "ms.", "dr.", "st.", "jr.", "sr.", "prof.", "vs.", "etc.", "e.g.", "i.e.")
_BAD_WORDS = ("sentence", "here's", "here is", "rephrase", "example", "assistant", "i can't", "as an ai")


def clean_sentence(text: str) -> str | None:
    """One generated reply -> its first sentence, or None if it is not a plain everyday sentence
    (too short / long, characters outside :data:`ALLOWED`, a meta-answer about the request)."""
    text = text.strip().split("\n")[0].strip().strip('"').strip("\u201c\u201d").strip()
    text = text.replace("\u2019", "'").replace("\u2018", "'")
    first = _SENTENCE_END.split(text)[0].strip().strip('"').strip()
    if not first or first[-1] not in ".!?":
        return None
    words = first.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or not ALLOWED.match(first):
        return None
    lowered = first.lower()
    if any(bad in lowered for bad in _BAD_WORDS) or not first[0].isupper():
        return None
    if lowered.endswith(_ABBREVIATIONS):  # cut inside "Mr. Smith ..." by the sentence split
        return None
    return first


def generate_smollm2(count: int, out: Path, model_dir: str | None = None, batch_size: int = 32,
                     max_new_tokens: int = 36, seed: int = 0, log: Callable[[str], None] = print) -> int:
    """Append SmolLM2-135M-Instruct's sentences to ``out`` (one per line) until it holds
    ``count`` distinct ones; returns how many it holds. Resumable: the file is the checkpoint, and
    batch b's prompts and sampling seed depend only on (seed, b), so a rerun continues the same
    sequence. Sampling: temperature 0.9, top-p 0.95, bf16 where fast, else fp32. ``out`` has no
    default: the package's own files (:func:`smollm2_text`) are what the ``smollm2`` and
    ``smollm2-more`` sources read, so a caller names them only to change those sources."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...hub import resolve_dtype, smollm2_checkpoint

    lines = out.read_text().splitlines() if out.exists() else []
    kept = {line.lower() for line in lines[1:]}
    header = f"# source: SmolLM2-135M-Instruct, mmspec train open-text (seed {seed})"
    batch = int(lines[0].split("batch ")[-1].rstrip(")")) if lines and "batch " in lines[0] else 0
    if len(kept) >= count:  # (done already: the model, which may not be on this machine, is not loaded)
        return len(kept)
    model_dir = model_dir or smollm2_checkpoint()
    if not lines:
        out.write_text(header + "\n")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype("auto")).eval()
    while len(kept) < count:
        rng = np.random.default_rng(stable_hash(f"open-text|{seed}|{batch}"))
        prompts = [STYLES[int(rng.integers(len(STYLES)))].format(topic=TOPICS[int(rng.integers(len(TOPICS)))])
                   for _ in range(batch_size)]
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": p + " Reply with the sentence only."}],
                                               tokenize=False, add_generation_prompt=True) for p in prompts]
        inputs = tokenizer(chats, return_tensors="pt", padding=True)
        torch.manual_seed(stable_hash(f"open-text-sample|{seed}|{batch}") % 2**63)
        with torch.inference_mode():
            tokens = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.9,
                                    top_p=0.95, pad_token_id=tokenizer.pad_token_id)
        replies = tokenizer.batch_decode(tokens[:, inputs.input_ids.shape[1]:], skip_special_tokens=True)
        new = []
        for reply in replies:
            text = clean_sentence(reply)
            if text and text.lower() not in kept:
                kept.add(text.lower())
                new.append(text)
        batch += 1
        lines = out.read_text().splitlines()
        lines[0] = f"{header} (next batch {batch})"
        out.write_text("\n".join(lines[:1] + lines[1:] + new) + "\n")
        log(f"open-text: batch {batch}: {len(new)} of {batch_size} kept, {len(kept)} of {count}")
    return len(kept)


def _split(texts: list[str], split: str) -> list[str]:
    check_split(split)
    seen, kept = set(), []
    for text in texts:
        key = text.lower()
        if key not in seen and split_of(f"open|{key}") == split and not is_held_out(text):
            seen.add(key)
            kept.append(text)
    return kept


#: the file of seed N >= 1's sentences, beside :data:`SMOLLM2_TEXT`
SEED_TEXT = "open_text_smollm2-seed{}.txt"


def smollm2_text(seed: int) -> Path:
    """Where ``mmspec train open-text --seed seed`` keeps its sentences (seed 0: :data:`SMOLLM2_TEXT`)."""
    return SMOLLM2_TEXT if seed == 0 else HERE / SEED_TEXT.format(seed)


def _seed_files() -> list[Path]:
    """The seed files of seeds 1 and up, in seed order (seed 10 after seed 2: a source's sentence
    order fixes which sentences each speech shard holds)."""
    prefix, suffix = SEED_TEXT.split("{}")
    seeds = (path.name[len(prefix):-len(suffix)] for path in HERE.glob(SEED_TEXT.format("*")))
    return [smollm2_text(int(seed)) for seed in sorted(int(s) for s in seeds if s.isdigit() and int(s) >= 1)]


def _generated(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines()[1:] if line.strip()] if path.exists() else []


def smollm2(split: str) -> list[str]:
    """The generated sentences (seed 0) of ``split`` (empty when ``open_text_smollm2.txt`` is missing)."""
    return _split(_generated(SMOLLM2_TEXT), split)


def smollm2_more(split: str) -> list[str]:
    """The sentences of ``split`` generated with seeds 1 and up, less those seed 0 wrote."""
    first = {text.lower() for text in _generated(SMOLLM2_TEXT)}
    more = [text for path in _seed_files() for text in _generated(path)]
    return _split([text for text in more if text.lower() not in first], split)


#: the files of fortunes-min the ``fortunes`` source reads (under :data:`FORTUNES`)
FORTUNE_FILES = ("fortunes", "literature", "riddles")


def system_file(source: str) -> tuple[Path, str] | None:
    """The Debian file a source reads and its package (``fortunes``: :data:`FORTUNES`, fortunes-min;
    ``words``: :data:`WORDS`, wamerican), or None for a source that ships with mmspec."""
    return {"fortunes": (FORTUNES, "fortunes-min"), "words": (WORDS, "wamerican")}.get(source)


def _missing(sources: list[str]) -> None:
    """MissingDependencyError (one line: the files, their packages, how to install them or leave the
    sources out) when a source's Debian file is not on this machine: without it the source used to
    give no sentences, silently, and a corpus (or a benchmark's sentences) of the other sources."""
    from ...hub import MissingDependencyError

    missing = {}
    for source in dict.fromkeys(sources):
        found = system_file(source)
        if found is None:
            continue
        path, package = found
        if not (any((path / name).is_file() for name in FORTUNE_FILES) if source == "fortunes" else path.is_file()):
            missing[source] = (path, package)
    if missing:
        said = ", ".join(f"{source!r} reads Debian's {package} ({path} is missing)" for source, (path, package) in missing.items())
        several = len(missing) > 1
        raise MissingDependencyError(f"the open-corpus source{'s' * several} {said}: install {'them' if several else 'it'} "
                                     f"(sudo apt-get install "
                                     f"{' '.join(package for _, package in missing.values())}) or leave "
                                     f"{', '.join(missing)} out of the sources")


def fortunes(split: str) -> list[str]:
    """Sentences of ``fortunes-min`` (MissingDependencyError when it is not installed)."""
    _missing(["fortunes"])
    texts = []
    for name in FORTUNE_FILES:
        path = FORTUNES / name
        if not path.exists():
            continue
        for entry in path.read_text(errors="replace").split("\n%\n"):
            body = " ".join(line.strip() for line in entry.splitlines() if not line.strip().startswith("--"))
            body = re.sub(r"\s+", " ", body.replace('"', "").replace("`", "'")).strip()
            for piece in _SENTENCE_END.split(body):
                piece = re.sub(r"^(Q|A):\s*", "", piece.strip().lstrip(".")).strip()
                if piece and piece[-1] in ".!?" and MIN_WORDS <= len(piece.split()) <= MAX_WORDS and ALLOWED.match(piece):
                    texts.append(piece[0].upper() + piece[1:])
    return _split(texts, split)


_WORD_FRAMES = (
    "The next word on the list is {0}.", "Can you spell the word {0}?", "She wrote {0} and {1} on the board.",
    "He said {0}, not {1}.", "Please add {0}, {1} and {2} to the notes.", "I looked up {0} in the dictionary.",
    "The answer was {0}.", "Say {0} slowly, then say {1}.", "Is {0} the right word here?",
    "They talked about {0} for an hour.", "My favourite word this week is {0}!",
)


def words(split: str, count: int = 1500) -> list[str]:
    """``count`` sentences built around lower-case words of ``wamerican`` (MissingDependencyError
    without it)."""
    _missing(["words"])
    vocabulary = [w for w in WORDS.read_text(errors="replace").split()
                  if w.isascii() and w.isalpha() and w.islower() and 3 <= len(w) <= 12]
    rng = np.random.default_rng(stable_hash("open-words"))
    texts = []
    for _ in range(count):
        frame = _WORD_FRAMES[int(rng.integers(len(_WORD_FRAMES)))]
        texts.append(frame.format(*(vocabulary[int(rng.integers(len(vocabulary)))] for _ in range(3))))
    return _split(texts, split)


_NAMES = ("Anna", "James", "Maria", "David", "Sofia", "Omar", "Grace", "Liam", "Chen", "Priya", "Lucas", "Emma",
          "Noah", "Fatima", "Oliver", "Yuki", "Daniel", "Hannah", "Mohammed", "Isabella")
_PLACES = ("Boston", "Paris", "Chicago", "Berlin", "Toronto", "Sydney", "Madrid", "Denver", "Dublin", "Seattle",
           "Oxford", "Nairobi", "Mumbai", "Lisbon", "Austin")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_THINGS = ("tickets", "books", "apples", "chairs", "emails", "students", "boxes", "miles", "pages", "people")


def ordinal(n: int) -> str:
    """3 -> "3rd", 11 -> "11th", 22 -> "22nd"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _number_frame(rng: np.random.Generator) -> str:
    n = lambda lo, hi: int(rng.integers(lo, hi))  # noqa: E731
    name, place, month = (x[n(0, len(x))] for x in (_NAMES, _PLACES, _MONTHS))
    frames = (
        f"{name} bought {n(2, 40)} {_THINGS[n(0, len(_THINGS))]} for ${n(1, 500)}.{n(10, 99)}.",
        f"The meeting is on {month} {n(1, 29)}, {n(1950, 2040)} at {n(1, 13)}:{n(0, 6)}{n(0, 10)} {'am' if n(0, 2) else 'pm'}.",
        f"Prices rose by {n(1, 30)}.{n(0, 10)}% last year.",
        f"The train to {place} leaves at {n(1, 13)}:{n(0, 6)}{n(0, 10)}.",
        f"Dr. {name} lives at {n(1, 999)} Main St. in {place}.",
        f"It was the {ordinal(n(1, 32))} time this month!",
        f"{name} finished {ordinal(n(1, 12))} in the race.",
        f"The population of {place} is about {n(1, 999):,},{n(0, 1000):03d}.",
        f"Call me on {n(200, 999)}-{n(100, 999)}-{n(1000, 9999)} before {n(1, 13)} pm.",
        f"Is it really {n(-20, 40)} degrees in {place} today?",
        f"The box weighs {n(1, 99)} kg and costs \u00a3{n(2, 90)}.",
        f"Was {name} born on {n(1, 13)}/{n(1, 29)}/{n(1940, 2020)}?",
        f"We need {n(2, 12)} more people by {month} {ordinal(n(1, 29))}.",
        f"In {n(1800, 2030)}, {name} moved to {place}.",
        f"Wow, {n(50, 100)}% of the tickets sold in {n(2, 59)} minutes!",
    )
    return frames[n(0, len(frames))]


def numbers(split: str, count: int = 1500) -> list[str]:
    """``count`` template sentences with numbers, dates, times, money, abbreviations and names."""
    rng = np.random.default_rng(stable_hash("open-numbers"))
    return _split([_number_frame(rng) for _ in range(count)], split)


def grammar(split: str, count: int = 1500) -> list[str]:
    """``count`` sentences of the voice's original grammar (already split by their own hash)."""
    return [grammar_sentence(split, i) for i in range(count)]


#: source name -> (sentences of a split, share of the corpus)
SOURCES: dict[str, tuple[Callable[[str], list[str]], float]] = {
    "smollm2": (smollm2, 0.40), "smollm2-more": (smollm2_more, 0.40), "fortunes": (fortunes, 0.15), "words": (words, 0.12),  # shares of the corpus
    "numbers": (numbers, 0.15), "grammar": (grammar, 0.18),
}


def check_sources(sources: list[str] | None) -> list[str]:
    """The open corpus' sources (None: all of :data:`SOURCES`), checked before any text is made:
    ValueError (one line naming the known sources) for an unknown name or an empty list;
    MissingDependencyError (one line naming the file and its Debian package) for a source whose
    system file this machine lacks. The one check of ``--sources`` and of :func:`open_corpus`."""
    sources = list(SOURCES) if sources is None else list(sources)
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown or not sources:
        raise ValueError(f"--sources: unknown {unknown or 'empty list'}; use a comma-separated list of {', '.join(SOURCES)}")
    repeated = sorted({name for name in sources if sources.count(name) > 1})
    if repeated:  # (the corpus took each once, but the shards were named after the list as given)
        raise ValueError(f"--sources: {', '.join(repeated)} given more than once; name each source once")
    _missing(sources)
    return sources


def parse_sources(text: str | None) -> list[str] | None:
    """``"fortunes, words"`` (a ``--sources`` option) -> ``["fortunes", "words"]``; None (every
    source) for None. Not checked here: :func:`open_corpus` checks them (:func:`check_sources`),
    once, before it makes any text."""
    return None if text is None else [name.strip() for name in text.split(",") if name.strip()]


def open_corpus(split: str, size: int | None = None, sources: list[str] | None = None) -> list[tuple[str, str]]:
    """``[(source, sentence)]`` of ``split``: the ``sources`` (default all of :data:`SOURCES`)
    interleaved by their shares (each source's sentences in a fixed shuffled order, repeated when
    ``size`` asks for more than it has), deterministic. ``size`` defaults to every sentence once.
    The sources are checked first (:func:`check_sources`: an unknown name, an empty list, a
    missing system file)."""
    sources, pools = check_sources(sources), {}
    for name in sources:
        make, share = SOURCES[name]
        texts = make(split)
        if texts:
            order = sample_rng("speech-open", split, stable_hash(name) % 2**31).permutation(len(texts))
            pools[name] = ([texts[i] for i in order], share)
    if not pools:  # (only the generated sources can be empty: their files were removed)
        raise ValueError(f"the open-corpus sources {', '.join(sources)} have no sentences "
                         f"of {split}; run mmspec train open-text for smollm2, or add other sources")
    total = sum(len(texts) for texts, _ in pools.values())
    size = total if size is None else size
    taken = {name: 0 for name in pools}
    corpus = []
    for _ in range(size):  # the source furthest behind its share goes next
        name = min(pools, key=lambda k: (taken[k] + 1) / pools[k][1])
        texts = pools[name][0]
        corpus.append((name, texts[taken[name] % len(texts)]))
        taken[name] += 1
    return corpus
