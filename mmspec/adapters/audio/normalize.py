"""Text normalisers: written text -> the words a TTS front end says (run before the phonemizer).

Registered by name in :data:`NORMALIZERS` (a model directory's ``tts.json`` may name one as
``"normalizer"``; without it the voice uses ``"english"``):

- ``"english"``: :class:`EnglishNormalizer`, num2words plus ordered rules: URLs and e-mail
  addresses, phone-like digit strings, currency, times, dates, units, percentages, ordinals,
  decades, years, ranges, fractions, cardinals (negative, decimal, with thousands commas),
  abbreviations, initialisms and symbols, read out as words; accented Latin letters transliterated
  (NFKD without the marks, ß -> ss); what is left that no English voice can say (emoji and
  emoticons such as "<3", CJK and other scripts, stray symbols, control characters) dropped and
  named in :attr:`NormalizedText.dropped`.
- ``"none"``: the text unchanged (for a front end that reads digits itself).

The output keeps sentence punctuation for prosody (``. , ? ! ...``; ``; :`` and brackets become
commas) and contains only ASCII letters, white space and ``. , ? ! ' -``, which every front end of
:mod:`~mmspec.adapters.audio.phonemes` can say. The rules are deterministic and idempotent:
normalising a normalised text gives it back.

Example:
    >>> normalize_text("Dr. Smith paid $49.99 on 3/4/2025 at 7:30 pm.")
    'Doctor Smith paid forty-nine dollars and ninety-nine cents on March fourth, twenty twenty-five at seven thirty P-M.'
"""

from __future__ import annotations

import re
import unicodedata
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from ...core.registry import build_named, factory_registrar

__all__ = ["EnglishNormalizer", "NORMALIZERS", "NormalizedText", "TextNormalizer", "make_normalizer", "normalize_text",
           "register_normalizer"]


@dataclass(frozen=True)
class NormalizedText:
    """text: what the front end is given; dropped: what was removed because nothing could say it
    (runs of letters of other scripts, symbols and emoji, as written: "日本", "😀"; distinct, in
    order of first appearance)."""

    text: str
    dropped: tuple[str, ...] = ()

    def describe_dropped(self) -> str:
        """The dropped runs as one short phrase for a message: ``'日本', '😀'`` (at most 12)."""
        shown = ", ".join(repr(c) for c in self.dropped[:12])
        return shown + (f" and {len(self.dropped) - 12} more" if len(self.dropped) > 12 else "")


class TextNormalizer(ABC):
    """text -> :class:`NormalizedText`."""

    name: str = ""

    def __call__(self, text: str) -> NormalizedText:
        if not isinstance(text, str):
            raise ValueError(f"the text must be a string, got {type(text).__name__}")
        return self.normalize(text)

    @abstractmethod
    def normalize(self, text: str) -> NormalizedText:
        """Any string -> its spoken form (never raises on content)."""


#: normaliser name -> factory
NORMALIZERS: dict[str, Callable[[], TextNormalizer]] = {}


#: ``@register_normalizer(name)``: register a factory as ``NORMALIZERS[name]`` (a taken name is refused)
register_normalizer = factory_registrar(NORMALIZERS, "text normaliser")


@lru_cache(maxsize=None)
def make_normalizer(name: str) -> TextNormalizer:
    """The normaliser called ``name`` (built once per process)."""
    return build_named(NORMALIZERS, "text normaliser", name)


def normalize_text(text: str, name: str = "english") -> str:
    """``text`` as the normaliser ``name`` says it (the training-data side uses this too, so the
    voice learns from the words it is given at inference)."""
    return make_normalizer(name)(text).text


@register_normalizer("none")
class IdentityNormalizer(TextNormalizer):
    name = "none"

    def normalize(self, text):
        return NormalizedText(text)


# --- number words ----------------------------------------------------------------------------

DIGITS = "zero one two three four five six seven eight nine".split()
NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+"  # 1,234.5 | 1234.5 | .5
MAX_CARDINAL_DIGITS = 15  # longer digit runs are read digit by digit


def _tidy(words: str) -> str:
    """num2words' British "and" and its thousands commas removed: American reading."""
    return re.sub(r"\s+", " ", words.replace(",", "").replace(" and ", " ")).strip()


def digits(run: str) -> str:
    """"4071" -> "four zero seven one" (non-digits ignored)."""
    return " ".join(DIGITS[int(d)] for d in run if d.isdigit())


def cardinal(number: str) -> str:
    """"-1,234.05" -> "minus one thousand two hundred thirty-four point zero five"."""
    from num2words import num2words

    sign = "minus " if number.startswith("-") else ""
    whole, _, fraction = number.lstrip("-+").replace(",", "").partition(".")
    if len(whole) > MAX_CARDINAL_DIGITS:
        return sign + digits(whole) + (" point " + digits(fraction) if fraction else "")
    words = _tidy(num2words(int(whole or "0")))
    return sign + words + (" point " + digits(fraction) if fraction else "")


def ordinal(n: int) -> str:
    from num2words import num2words

    return _tidy(num2words(n, to="ordinal"))


def year(n: int) -> str:
    """1999 -> "nineteen ninety-nine", 2005 -> "two thousand five", 1905 -> "nineteen oh-five"."""
    from num2words import num2words

    return _tidy(num2words(n, to="year"))


def plural_words(words: str) -> str:
    """"nineteen ninety" -> "nineteen nineties"; "two thousand" -> "two thousands"; "six" -> "sixes"."""
    if words.endswith("y"):
        return words[:-1] + "ies"
    return words + ("es" if words.endswith("x") else "s")


def _is_one(number: str) -> bool:
    return number.replace(",", "") in ("1", "-1")


def fraction(top: int, bottom: int) -> str:
    """(3, 4) -> "three quarters", (1, 2) -> "one half", (5, 8) -> "five eighths"."""
    if bottom == 2:
        name = "half" if top == 1 else "halves"
    elif bottom == 4:
        name = "quarter" if top == 1 else "quarters"
    else:
        name = ordinal(bottom) + ("" if top == 1 else "s")
    return f"{cardinal(str(top))} {name}"


def roman_value(numeral: str) -> int | None:
    """"XIV" -> 14 for a numeral of :data:`ROMAN` letters written the usual way ("IIII", "VX" -> None)."""
    values = [ROMAN[c] for c in numeral]
    total = sum(-v if i + 1 < len(values) and v < values[i + 1] else v for i, v in enumerate(values))
    return total if total > 0 and to_roman(total) == numeral else None


def to_roman(n: int) -> str:
    """14 -> "XIV" (1 to 89)."""
    out = ""
    for value, letters in ((50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")):
        count, n = divmod(n, value)
        out += letters * count
    return out


def slash_reading(a: int, b: int, date_context: bool = False) -> str:
    """"a/b" without a year, said: a month/day date after a date word (``date_context``: "on
    4/5" -> "on April fifth"); a proper fraction of a common denominator (:data:`FRACTION_DENOMINATORS`)
    as one ("3/4", "1/10"); else a valid month/day as a date ("12/25", "9/11", "1/1"); else a
    proper fraction ("13/20"); else the two numbers ("24/7", "50/50"); "a/0" stays written."""
    date = 1 <= a <= 12 and 1 <= b <= 31
    if b == 0:
        return f"{a}/{b}"
    if date and (date_context or not (a < b and b in FRACTION_DENOMINATORS)):
        return f"{MONTHS[a - 1]} {ordinal(b)}"
    return fraction(a, b) if a < b else f"{cardinal(str(a))} {cardinal(str(b))}"


# --- rule tables -------------------------------------------------------------------------------

#: denominators a proper "a/b" is read as a fraction by even where it could be a month/day
#: (halves to twelfths but elevenths, and sixteenths: recipes, inches); "9/11", "12/25" are dates
FRACTION_DENOMINATORS = {2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16}
#: a rate's unit after "/" ("$5/mo" -> "five dollars per month"); another word is said as written
RATE_UNITS = {"s": "second", "sec": "second", "min": "minute", "h": "hour", "hr": "hour", "d": "day", "wk": "week",
              "mo": "month", "yr": "year"}
#: a word before "a/b" that makes it a month/day date ("on 4/5", "due 3/15")
DATE_CONTEXT = r"\b(?:on|until|till|since|before|after|dated|due)\s+$"

#: an operand of written arithmetic: a number, maybe times a variable ("5x"), or a one-letter variable
OPERAND = r"(?:(?:\d+(?:\.\d+)?|\.\d+)[a-z]?|[A-Za-z])(?!\w)"
#: operands joined by operators: arithmetic where one of them is "=" ("x = y - 5", "10/2=5")
EQUATION = rf"(?<![\w.,/-]){OPERAND}(?:\s*[-+*/=\u00d7\u00f7]\s*{OPERAND})+"
#: how an equation's hyphen and slash are read (the other operators' words are :meth:`_symbols`')
EQUATION_OPERATORS = {"-": "minus", "/": "divided by"}

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
MONTH_NAMES = {m.lower(): m for m in MONTHS} | {m[:3].lower(): m for m in MONTHS} | {"sept": "September"}
MONTH = r"(?:January|February|March|April|May|June|July|August|September|October|November|December|" \
        r"Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec)"

#: currency sign -> (unit, units, sub-unit, sub-units)
CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "£": ("pound", "pounds", "penny", "pence"),
              "€": ("euro", "euros", "cent", "cents"), "¥": ("yen", "yen", None, None),
              "₹": ("rupee", "rupees", "paisa", "paise")}
#: a regex class of the currency signs
SIGN = "[" + "".join(CURRENCIES) + "]"
#: ISO codes, before or after an amount, read as their sign's words ("5 USD" -> "five dollars")
CURRENCY_CODES = {"USD": "$", "EUR": "€", "GBP": "£", "JPY": "¥", "INR": "₹"}
#: a country's letters before a dollar sign ("US$5", "C$20", "A$3")
DOLLAR_PREFIXES = {"US": "U-S", "CA": "Canadian", "C": "Canadian", "AUS": "Australian", "AU": "Australian", "A": "Australian",
                   "NZ": "New Zealand", "HK": "Hong Kong", "S": "Singapore"}
SCALES = {"thousand": "thousand", "k": "thousand", "million": "million", "m": "million", "mn": "million",
          "billion": "billion", "bn": "billion", "b": "billion", "trillion": "trillion", "tn": "trillion"}

#: unit abbreviation -> (singular, plural); matched after a number, case-sensitive
UNITS = {
    "km/h": ("kilometer per hour", "kilometers per hour"), "mph": ("mile per hour", "miles per hour"),
    "kph": ("kilometer per hour", "kilometers per hour"), "°C": ("degree Celsius", "degrees Celsius"),
    "°F": ("degree Fahrenheit", "degrees Fahrenheit"), "°": ("degree", "degrees"),
    "km": ("kilometer", "kilometers"), "cm": ("centimeter", "centimeters"), "mm": ("millimeter", "millimeters"),
    "m": ("meter", "meters"), "mi": ("mile", "miles"), "ft": ("foot", "feet"), "yd": ("yard", "yards"),
    "kg": ("kilogram", "kilograms"), "mg": ("milligram", "milligrams"), "g": ("gram", "grams"),
    "lbs": ("pound", "pounds"), "lb": ("pound", "pounds"), "oz": ("ounce", "ounces"),
    "ml": ("milliliter", "milliliters"), "mL": ("milliliter", "milliliters"), "L": ("liter", "liters"),
    "hrs": ("hour", "hours"), "hr": ("hour", "hours"), "h": ("hour", "hours"), "min": ("minute", "minutes"),
    "mins": ("minute", "minutes"), "sec": ("second", "seconds"), "ms": ("millisecond", "milliseconds"),
    "kWh": ("kilowatt hour", "kilowatt hours"), "kW": ("kilowatt", "kilowatts"), "W": ("watt", "watts"),
    "V": ("volt", "volts"), "GHz": ("gigahertz", "gigahertz"), "MHz": ("megahertz", "megahertz"),
    "Hz": ("hertz", "hertz"), "TB": ("terabyte", "terabytes"), "GB": ("gigabyte", "gigabytes"),
    "MB": ("megabyte", "megabytes"), "KB": ("kilobyte", "kilobytes"), "kB": ("kilobyte", "kilobytes"),
}

#: abbreviations always followed by a name: the period is not a sentence end
TITLES = {"Dr.": "Doctor", "Mr.": "Mister", "Mrs.": "Missus", "Ms.": "Miz", "Prof.": "Professor", "Mt.": "Mount",
          "Gen.": "General", "Gov.": "Governor", "Sen.": "Senator", "Capt.": "Captain", "Lt.": "Lieutenant",
          "Sgt.": "Sergeant", "Rev.": "Reverend", "Ft.": "Fort", "vs.": "versus", "vs": "versus",
          "e.g.": "for example", "i.e.": "that is"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
#: "Jan." -> "January", "Tues." -> "Tuesday" (not "May", a word; "Jan" without its period may be a name)
CALENDAR_ABBREVIATIONS = ({f"{m[:3]}.": m for m in MONTHS if m != "May"} | {"Sept.": "September"}
                          | {f"{d[:3]}.": d for d in DAYS} | {"Tues.": "Tuesday", "Thur.": "Thursday", "Thurs.": "Thursday"})
#: the calendar abbreviations that are words too ("I love the Sun."): expanded only where a
#: lower-case word, a digit, a comma or a month follows
WORDLIKE_ABBREVIATIONS = {"Mar.", "Sat.", "Sun."}
#: abbreviations that may end a sentence (the period is kept there)
ABBREVIATIONS = {"etc.": "et cetera", "approx.": "approximately", "Jr.": "Junior", "Sr.": "Senior", "Ave.": "Avenue", "Rd.": "Road",
                 "Blvd.": "Boulevard", "Dept.": "Department", "Inc.": "Incorporated", "Ltd.": "Limited",
                 "Corp.": "Corporation", "Co.": "Company", "Univ.": "University", "w/": "with", "a.k.a.": "also known as",
                 "Ph.D.s": "P-H-D's", "Ph.D.": "P-H-D", "M.Sc.": "M-S-C", "B.Sc.": "B-S-C", "M.Phil.": "M-phil",
                 "Apt.": "Apartment"} | {k: v for k, v in CALENDAR_ABBREVIATIONS.items() if k not in WORDLIKE_ABBREVIATIONS}

#: all-capital words read as words (not spelled), and ones spelled though they look like words
ACRONYMS_AS_WORDS = {"NASA", "NATO", "UNESCO", "UNICEF", "NAFTA", "OPEC", "FIFA", "UEFA", "NASCAR", "SCUBA", "LASER",
                     "RADAR", "COVID", "AIDS", "GIF", "IKEA", "LEGO", "PIN", "SIM", "CERN", "ASEAN", "SARS", "WASP",
                     "NIMBY", "POTUS", "SWAT", "ZIP", "JPEG", "OSHA", "FEMA", "DARPA", "INTERPOL", "EFTA", "SONAR"}
ACRONYMS_SPELLED = {"USDA", "NCAA", "ACLU", "UCLA", "USSR", "OECD", "ESPN", "NAACP", "IEEE", "AARP", "USAF", "UEFI",
                    "IOU", "AI", "OS", "US", "EU", "UN", "UK", "IOS", "API", "CEO", "CFO", "COO"}
#: short all-capital words read as words ("I LOVE IT" is shouting, not initialisms)
SHORT_WORDS = set("""A AN AM AND ANY ARE AS AT BE BIG BUT BY CAN DID DO DOG FOR GET GO GOD GOT HAD HAS HE HER HI HIM
HIS HOW I IF IN IS IT ITS LET ME MY NEW NO NOT NOW OF OFF OH OLD ON ONE OR OUR OUT RUN SAY SEE SHE SO THE TO TOO TWO
UP WAS WAY WE WHO WHY WIN YES YET YOU""".split())
#: short words that are initialisms too ("the IT department", "AM radio"): read as words only in
#: shouting (next to another all-capital word, or on a line without lower-case letters)
SHORT_INITIALISMS = {"IT", "AM"}
SPOKEN_WORDS = {"OK": "okay", "PhD": "P-H-D", "PhDs": "P-H-D's", "TV": "T-V", "Wi-Fi": "wifi", "WiFi": "wifi"}

#: Roman numeral letters -> values (I V X L only: "MIX", "DIV", "CIVIL", "CD" are words or initialisms)
ROMAN = {"I": 1, "V": 5, "X": 10, "L": 50}
#: numerals of two letters or more left spelled after a name ("Size XL")
NOT_ROMAN = {"XL"}
#: names a numeral after is regnal, said "the second" ("Elizabeth II", "Louis XIV", "John Paul II");
#: after another capitalised word it is a cardinal ("World War II", "Rocky IV", "Super Bowl LVIII")
REGNAL_NAMES = set("""Alexander Alfonso Amenhotep Anne Benedict Boniface Carlos Catherine Charles Christian Clement
Constantine Edward Elizabeth Ferdinand Francis Frederick George Gregory Gustav Haakon Harald Henri Henry Innocent
Ivan James John Juan Leo Leopold Louis Ludwig Mary Napoleon Nicholas Olaf Otto Paul Pedro Peter Philip Pius Ptolemy
Ramesses Richard Robert Rudolf Sixtus Stephen Urban Victor Wilhelm William""".split())

#: words before a four-digit number that make it a count, not a year ("paid 1999")
COUNT_BEFORE = {"paid", "pay", "pays", "paying", "cost", "costs", "costing", "priced", "worth", "total", "totals"}
#: words before a four-digit number that keep it a year though a plural follows ("in 1999 prices")
YEAR_BEFORE = {"in", "since", "from", "until", "till", "by", "of", "to", "for", "the", "during", "before", "after", "circa",
               "year", "early", "late", "mid", "spring", "summer", "autumn", "fall", "winter", "between", "around"}
#: words after one that end in "s" but are no plural ("1999 was"), and plurals that do not ("1999 people")
NOT_PLURALS = {"is", "was", "has", "as", "its", "this", "thus", "us", "his", "hers", "yours", "ours", "theirs", "always",
               "perhaps", "whereas", "towards", "besides", "plus", "less", "unless", "across", "series"}
IRREGULAR_PLURALS = {"people", "men", "women", "children", "feet", "teeth", "mice", "geese", "sheep", "fish", "deer",
                     "yen", "staff", "cattle", "police"}
#: emergency and service numbers said digit by digit after "call" / "dial"
SERVICE_NUMBERS = ("911", "999", "112", "000", "111", "101", "311", "411", "988")

#: URL / e-mail pieces read out
URL_SYMBOLS = {".": " dot ", "/": " slash ", "-": " dash ", "_": " underscore ", "@": " at ", ":": " colon ",
               "?": " question mark ", "=": " equals ", "&": " and ", "+": " plus ", "#": " hash ", "~": " tilde ",
               "%": " percent "}
SPELLED_LABELS = {"uk", "us", "io", "ai", "tv", "eu", "de", "fr", "ca", "au", "nz", "www"}
TLDS = r"(?:com|org|net|edu|gov|io|co|uk|us|de|fr|ai|dev|info|app|biz|me|tv|ca|au|eu|ly|gg|nz)"

#: characters no rule can read that map to a spoken pause or are silently dropped as formatting
PUNCTUATION_MAP = {";": ",", ":": ",", "(": ", ", ")": ", ", "[": ", ", "]": ", ", "{": ", ", "}": ", ", '"': " ",
                   "—": ", ", "–": ", ", "…": "...", "\u2018": "'", "\u2019": "'", "\u201c": " ", "\u201d": " ",
                   "\u00ab": " ", "\u00bb": " ", "\u00a1": " ", "\u00bf": " ", "*": " ", "_": " ", "`": "'",
                   "\u3002": ".", "\u3001": ",", "\u300c": " ", "\u300d": " ", "\u300e": " ", "\u300f": " "}
#: Latin letters NFKD does not decompose
LATIN = {"ß": "ss", "æ": "ae", "Æ": "AE", "ø": "o", "Ø": "O", "œ": "oe", "Œ": "OE", "ł": "l", "Ł": "L", "đ": "d",
         "Đ": "D", "þ": "th", "Þ": "Th", "ð": "d", "Ð": "D", "ı": "i", "ŋ": "ng"}
SAYABLE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,?!'-\n")
#: single-character fractions (NFKC turns "2½" into "21⁄2": they are spaced from a digit before it)
VULGAR_FRACTIONS = "¼½¾⅐⅑⅒⅓⅔⅕⅖⅗⅘⅙⅚⅛⅜⅝⅞"
#: list bullets: dropped as formatting, not named (other punctuation no rule reads is named)
BULLETS = set("•·‣⁃∙◦")
#: abbreviations read as words before a number ("Fig. 3", "Vol. 2"), as "No. 5" is
NUMBERED = {"Fig": "Figure", "Figs": "Figures", "Vol": "Volume", "Vols": "Volumes", "Ch": "Chapter", "Chap": "Chapter",
            "Eq": "Equation", "Eqs": "Equations", "Sec": "Section", "Sect": "Section", "Art": "Article", "Para": "Paragraph",
            "pp": "pages", "p": "page", "Pt": "Part", "Ex": "Example", "Tab": "Table", "Ref": "Reference"}
#: file name extensions read "dot ..." ("config.yaml": a file, not two sentences)
FILE_EXTENSIONS = ("txt|csv|tsv|json|jsonl|yaml|yml|toml|ini|cfg|xml|html?|md|rst|pdf|docx?|xlsx?|pptx?|png|jpe?g|gif|"
                   "svg|webp|wav|mp3|flac|ogg|mp4|mov|avi|mkv|zip|gz|tar|tgz|7z|rar|exe|dmg|apk|iso|py|ipynb|js|ts|"
                   "jsx|tsx|css|cpp|hpp|c|h|rs|go|java|kt|rb|php|sh|bat|ps1|sql|db|log|bin|onnx|pt|safetensors")


#: emoticons dropped and named in :attr:`NormalizedText.dropped`, as emoji are ("I <3 you" was "I less
#: than three you", ":D" "D"); only standing alone, not after a number or an operator ("2 <3 4", "x<3")
EMOTICONS = ("</3", "<3", ":-)", ":)", ":-(", ":(", ":-D", ":D", ";-)", ";)", ":-P", ":P", ":-p", ":p")
#: the private-use characters that stand for :data:`EMOTICONS` between the first rule and the final filter
EMOTICON_MARKS = {chr(0xF0000 + i): e for i, e in enumerate(EMOTICONS)}
EMOTICON_AS_MARK = {e: m for m, e in EMOTICON_MARKS.items()}
#: an emoticon standing alone; a heart not after a number or an operator ("2 <3 4")
EMOTICON_PATTERN = re.compile(r"(?<!\S)(?:(?<![\d=+*/-] )(?:{})|{})(?=\s|$|[.,!?])".format(
    "|".join(re.escape(e) for e in EMOTICONS if "3" in e), "|".join(re.escape(e) for e in EMOTICONS if "3" not in e)))
#: the numero sign: "Nº 5", "nº 7", "№ 9" -> "number ..." (NFKC makes "Nº" "No" and "№" "No")
NUMERO = r"(?<![A-Za-z])(?:[Nn]\u00ba|\u2116)\s?"
#: "Ns of": a multiple, not seconds ("10s of people" -> "tens of people"); another "Ns" is seconds
MULTIPLES_OF = {"10": "tens", "100": "hundreds", "1000": "thousands", "1,000": "thousands"}
#: words after "20s" ... "90s" that make it a duration ("wait 30s and retry"); another lower-case
#: word after it makes it a decade ("90s music"), as "the", a possessive or "mid" before it does
AFTER_SECONDS = {"and", "or", "then", "later", "ago", "before", "after", "for", "left", "each", "per", "in", "at", "on",
                 "to", "from", "until", "till", "between", "with", "without", "is", "was", "are", "were", "long", "more",
                 "less", "only", "so", "but", "if", "of", "timeout", "delay", "interval", "wait", "max", "maximum"}
#: a foot or inch mark after a number: ' ’ ′ and " ″ (NFKC's ″ is ′′)
FOOT = "['\u2019\u2032]"
INCH = "(?:\"|''|\u2032\u2032)"
#: a time with its meridian or a clock time, before or after "noon" / "midnight" in a range
TIME = r"\d{1,2}(?::\d{2})?\s?[AaPp]\.?\s?[Mm]\b\.?|\d{1,2}:\d{2}"

#: superscript digits and signs, as NFKC reads them
SUPERSCRIPTS = "⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺"


def _superscript(match: re.Match) -> str:
    """A superscript after a word or digit: "m²" -> "m squared", "m³" -> "m cubed", "10²³" ->
    "10 to the power of 23", "10⁻³" -> "10 to the power of minus 3" (NFKC alone made them 1023)."""
    base, power = match.group(1), unicodedata.normalize("NFKC", match.group(2)).replace("−", "-")
    if base.isalpha() and power in ("2", "3"):
        return f"{base} {'squared' if power == '2' else 'cubed'}"
    return f"{base} to the power of {power.replace('-', 'minus ').replace('+', '')}"


def _ranges_before(text: str, end: str, suffix: str) -> str:
    """"A-B<suffix>" -> "A to B<suffix>" where B matches ``end`` and a ``suffix`` follows (the rule
    that reads the suffix then reads B; A is read as a number): "10-20%", "3-4 pm", "5-10 km";
    ``end`` may repeat the suffix on A ("10%-20%")."""
    return re.sub(rf"(?<![\w.,-])({end}(?:\s?{suffix})?)\s?[-\u2013]\s?(?={end}\s?{suffix})", r"\1 to ", text)


def _multiplier(match: re.Match) -> str:
    """"2x faster", "a 1.38x speedup" -> "2 times" (it was "two x"); left as written in arithmetic
    (a line with an "=", an operator before or after it: "y = 5x", "5x minus 3")."""
    line = match.string[match.string.rfind("\n", 0, match.start()) + 1:].split("\n", 1)[0]
    if ("=" in line or re.search(r"(?:[+*/\u00d7\u00f7]|(?<![\d.])-)\s*$", match.string[: match.start()])
            or re.match(r"\s+(?:minus|plus|times)\b", match.string[match.end():])):
        return match.group(0)
    return f"{match.group(1)} times"


def _mark_unit(quote: str, singular: str, plural: str) -> Callable[[re.Match], str]:
    """A foot (``quote`` "'") or inch ('"') mark after a number read as the unit ("5'" -> "five
    feet", "15\"" -> "fifteen inches"), unless an opening quote before it on its line is still open
    (then the mark closes it: "said '5'", "typed \"5\""); apostrophes inside words and "'80s" are no quotes."""
    def said(m: re.Match) -> str:
        start = m.string.rfind("\n", 0, m.start()) + 1
        line = m.string[start: m.start()]
        if quote == "'":  # opening: no letter before, something after; closing: the other way round
            inside = (len(re.findall(r"(?<!\w)['\u2018\u2019](?!\d0s\b)(?=\S)", line))
                      > len(re.findall(r"(?<=\S)['\u2019\u2032](?!\w)", line)))
        else:  # a straight double quote opens and closes alike
            inside = line.count('"') % 2 == 1
        if inside:
            return m.group(0)
        return f"{cardinal(m.group(1))} {singular if _is_one(m.group(1)) else plural}"

    return said


def _fraction_of_unit(m: re.Match) -> str:
    """'3/4"' -> "three quarters of an inch", "1/2'" -> "one half of a foot", '5/4"' -> "five quarters inches"."""
    top, bottom = int(m.group(1)), int(m.group(2))
    inch = re.fullmatch(FOOT, m.group(3)) is None
    if top < bottom:
        return f"{fraction(top, bottom)} of {'an inch' if inch else 'a foot'}"
    return f"{fraction(top, bottom)} {'inches' if inch else 'feet'}"


def _sentence_end(text: str, end: int) -> bool:
    """Does a sentence end right after ``text[:end]``? (end of text or of a line, or white
    space and a capital letter follow.)"""
    rest = text[end:]
    return not rest.strip() or rest.startswith("\n") or re.match(r"\s+[A-Z]", rest) is not None


@register_normalizer("english")
class EnglishNormalizer(TextNormalizer):
    """Written English -> spoken English, rule by rule (:meth:`normalize` lists the order).

    Heuristics worth knowing: a bare four-digit number from 1100 to 2099 is read as a year
    ("in 1999", "in 1999 prices") unless a price word precedes it or a plural follows it ("paid
    1999", "1999 people": counts); "3/4/2025" is month/day/year unless the first number cannot be
    a month, and "a/b" without a year is a date, a fraction or two numbers by :func:`slash_reading`;
    digit runs with a leading zero, of 8 or more digits, or in a phone pattern (555-123-4567) are
    read digit by digit; an all-capital word is spelled ("F-B-I") when it has 3 letters or fewer or
    no vowel, read as a word when longer ("NASA", shouting), with small lists of exceptions each
    way; a Roman numeral after a capitalised word is a number (:meth:`_roman`).
    """

    name = "english"

    def normalize(self, text):
        text = self._characters(self._emoticons(text))
        for rule in (self._markup, self._emails, self._urls, self._files, self._abbreviations, self._signs, self._rates, self._currency, self._times,
                     self._dates,
                     self._phones, self._units, self._percentages, self._ordinals, self._decades, self._ranges,
                     self._years, self._fractions, self._numbers, self._roman, self._initialisms, self._symbols):
            text = rule(text)
        text, dropped = self._final(text)
        return NormalizedText(text, tuple(dict.fromkeys(dropped)))

    # -- characters

    @staticmethod
    def _emoticons(text: str) -> str:
        """An emoticon of :data:`EMOTICONS` standing alone -> its private-use mark (:data:`EMOTICON_MARKS`),
        which no rule reads and :meth:`_final` drops and names as written."""
        return EMOTICON_PATTERN.sub(lambda m: EMOTICON_AS_MARK[m.group(0)], text)

    @staticmethod
    def _characters(text: str) -> str:
        """NFKC (full-width forms, ligatures, ℃ -> °C), then accented Latin letters -> ASCII;
        control characters -> space; anything else kept for the rules or the final filter."""
        text = re.sub(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|[@-Z\\-_])", "", text)  # terminal escapes ("\x1b[31m")
        text = re.sub(r"(?<=\d)[\u00a0\u202f\u2009](?=\d{3}(?!\d))", "", text)  # "5 000" with a no-break space: 5000
        # "1 000 000" with plain spaces: one number where a 1-3 digit lead (not 0) has only groups of
        # exactly three digits after it ("5 10 15", "555 123 4567" stay apart)
        text = re.sub(r"(?<![\w,.])(?<!\d )[1-9]\d{0,2}(?: \d{3})+(?:\.\d+)?(?![\w]|[.,]\d| \d)", lambda m: m.group(0).replace(" ", ""), text)
        text = re.sub(NUMERO, "number ", text)  # before NFKC makes "Nº" "No"
        text = "".join(c for c in text if unicodedata.category(c) != "Cf")  # zero-width and soft hyphens: joined
        text = re.sub(f"([\\w)])([{SUPERSCRIPTS}]+)", _superscript, text)  # before NFKC makes "10³" 103
        text = re.sub(f"(\\d?)([{VULGAR_FRACTIONS}])", lambda m: m.group(1) + (" " if m.group(1) else "")
                      + unicodedata.normalize("NFKC", m.group(2)), text)  # "2½" -> "2 1/2", not NFKC's "21/2"
        text = unicodedata.normalize("NFKC", text).replace("\u2044", "/").replace("\r\n", "\n").replace("\r", "\n")
        text = re.sub(r"(?<=\d)--(?=\d)", "\u2013", text)  # "10--20": TeX's en dash, a range
        text = re.sub(r"(?<!-)-{2,3}(?!-)", " \u2014 ", text)  # "Wait -- what", "---": a typewriter's dash
        out = []
        for c in text:
            if c.isascii():
                out.append(c if c.isprintable() or c == "\n" else " ")
            elif c in LATIN:
                out.append(LATIN[c])
            else:
                base = "".join(b for b in unicodedata.normalize("NFKD", c) if not unicodedata.combining(b))
                out.append(base if base and base.isascii() and base.isalpha() else c)
        return "".join(out)

    @staticmethod
    def _final(text: str) -> tuple[str, tuple[str, ...]]:
        """Pauses for ; : brackets and dashes (a spaced hyphen no rule read, "home - it", is a dash),
        quotes dropped, then everything not in
        :data:`SAYABLE` dropped (letters of other scripts, digits of other scripts and symbols
        named), white space and repeated punctuation tidied."""
        dropped = []
        out = []
        text = re.sub(r"(?<=\S)[ \t]+-[ \t]+(?=\S)", " \u2014 ", text)  # "home - it": a spaced hyphen left is a dash
        run = ""  # the dropped characters since the last one kept
        for c in text:
            if c in SAYABLE or c in PUNCTUATION_MAP:
                out.append(PUNCTUATION_MAP.get(c, c))
                if run:
                    dropped.append(run)
                    run = ""
            elif c in EMOTICON_MARKS:
                run += EMOTICON_MARKS[c]
                out.append(" ")
            else:
                category = unicodedata.category(c)
                if category[0] in "LNS" or (category == "Po" and c not in BULLETS) or (category[0] == "M" and run):
                    run += c  # named (with a dropped word's vowel signs: "हिन्दी" whole); not control and format characters, bullets, quotes, brackets
                out.append(" ")
        if run:
            dropped.append(run)
        text = "".join(out)
        text = re.sub(r"[ \t]+", " ", text)
        text = re.sub(r" *\n[\s]*", "\n", text).strip()
        text = re.sub(r" +([.,?!])", r"\1", text)                       # no space before punctuation
        text = re.sub(r"(?<![.])\.\.(?![.])", ".", text)               # ".." -> "." (an ellipsis stays)
        text = re.sub(r"([,?!])[,?!]*", r"\1", text)                    # "!!!" -> "!", "?!" -> "?", ",," -> ","
        text = re.sub(r",(?=[.?!])", "", text)                           # ",." -> "."
        text = re.sub(r"(?<![.])\.[?!]+", ".", text)                     # ".!" (a dropped run between) -> "."
        text = re.sub(r"([?!])\.(?![.])", r"\1", text)                  # "!." -> "!"
        text = re.sub(r"(^|\n)[,.?! ]+", r"\1", text)                    # no line starts with punctuation
        text = re.sub(r"([,.?!])(?=[A-Za-z])", r"\1 ", text)             # a space after punctuation
        text = re.sub(r"(?<![A-Za-z])'+|'+(?![A-Za-z])", " ", text)      # quotes, not apostrophes
        text = re.sub(r"(?<![A-Za-z])-+|-+(?![A-Za-z])", " ", text)      # a dash that joins nothing
        text = re.sub(r"[ \t]+", " ", text)
        text = re.sub(r" +([.,?!])", r"\1", text)
        text = re.sub(r" *\n *", "\n", text).strip()
        return text, tuple(dropped)

    # -- URLs and e-mail addresses

    @staticmethod
    def _read_address(address: str) -> str:
        """"www.example-shop.co.uk/news" -> "w w w dot example dash shop dot co dot u k slash news"."""
        out = []
        for piece in re.split(r"([^A-Za-z0-9])", address):
            if not piece:
                continue
            if piece in URL_SYMBOLS:
                out.append(URL_SYMBOLS[piece])
            elif piece.isdigit():
                out.append(" " + digits(piece) + " ")
            elif piece.lower() in SPELLED_LABELS or (piece.isalpha() and not re.search(r"[aeiouyAEIOUY]", piece)):
                out.append(" " + " ".join(piece.lower()) + " ")
            else:
                sub = re.sub(r"(\d+)", lambda m: " " + digits(m.group(1)) + " ", piece)
                out.append(" " + sub + " ")
        return re.sub(r"\s+", " ", "".join(out)).strip()

    def _urls(self, text: str) -> str:
        def url(m):
            found = m.group(0)
            trail = re.search(r"[.,!?;:)\]'\"]+$", found)
            tail = trail.group(0) if trail else ""
            found = found[: len(found) - len(tail)]
            address = re.sub(r"^[A-Za-z][A-Za-z0-9+.-]*://", "", found).rstrip("/")
            return " " + self._read_address(address) + tail
        pattern = (r"\b(?:https?|ftp)://[^\s<>\"]+|\bwww\.[^\s<>\"]+|"
                   rf"\b[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.{TLDS}\b(?:/[^\s<>\"]*)?(?!@)")
        return re.sub(pattern, url, text)

    def _emails(self, text: str) -> str:
        return re.sub(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b",
                      lambda m: self._read_address(m.group(0)), text)

    @staticmethod
    def _markup(text: str) -> str:
        """Plain-text and Markdown structure at a line's start: a heading's "#"s are dropped ("# Intro"
        was "hash Intro"), a list's number is followed by a pause, not a period ("1. Mix" was "one." and
        "Mix" said as two sentences)."""
        text = re.sub(r"^([ \t]*)#{1,6}[ \t]+(?=[^\W\d_])", r"\1", text, flags=re.MULTILINE)
        return re.sub(r"^([ \t]*\d{1,2})[.)][ \t]+(?=\S)", r"\1, ", text, flags=re.MULTILINE)

    @staticmethod
    def _files(text: str) -> str:
        """"config.yaml" -> "config dot yaml" (a file name, not a sentence end); ".NET", "ASP.NET" -> "dot net"."""
        text = re.sub(r"(?<![.])\.NET\b", " dot net", text)
        return re.sub(rf"(?<![\w.])([A-Za-z0-9_-]{{2,}}(?:\.[A-Za-z0-9_-]+)*)\.({FILE_EXTENSIONS})\b(?![.-]?\w)",
                      lambda m: f"{m.group(1).replace('.', ' dot ')} dot {m.group(2)}", text)

    @staticmethod
    def _signs(text: str) -> str:
        """A minus sign before an amount, fraction or number: "-$25", "$-5", "-1/2", "-5" -> "minus ..."
        (a hyphen after a word, number or percent sign is a range or a compound, not a sign); a star
        between numbers: "5 * 3" -> "5 times 3" ("*emphasis*" stays formatting). Arithmetic: in an
        :data:`EQUATION` (numbers and one-letter variables joined by operators, one of them ``=``) a
        hyphen is "minus" and a slash "divided by" ("7 - 3 = 4", "x = y - 5", "10/2=5"), and so is a
        hyphen after a lower-case variable and before a digit ("x-5", "5x-3"); elsewhere "5-10" and
        "7 - 3" stay ranges. The minus sign
        U+2212 (typeset text's: "−5 °C") is always a minus: "5 − 3" -> "5 minus 3", "−5" as "-5";
        "-inf" and "-∞" -> "minus infinity". A tilde between numbers is a range: "5~10" -> "5 to 10"
        (elsewhere "about": :meth:`_symbols`); "1e6" -> "1 times 10 to the power of 6"; "3 x 4",
        "1920x1080" -> "3 by 4" (dimensions); "2x faster", "1.38x" -> "2 times" (not after an operator)."""
        text = re.sub(r"(?<=[\w.%)])\s*\u2212", " minus ", text).replace("\u2212", "-")
        text = re.sub(EQUATION, lambda m: re.sub(r"\s*([-/])\s*", lambda o: f" {EQUATION_OPERATORS[o.group(1)]} ",
                                                 m.group(0)) if "=" in m.group(0) else m.group(0), text)
        text = re.sub(r"(?<![\w.])(\d*[a-z])-(?=\d)", r"\1 minus ", text)  # "x-5", "5x-3": a variable's minus
        text = re.sub(r"(?<![\w.])-\s?(?:inf(?:inity)?\b|\u221e)", "minus infinity", text)
        text = re.sub(rf"({SIGN})\s?-(?=\.?\d)", r"minus \1", text)
        text = re.sub(rf"(?<![\w.%])-(?={SIGN}?\.?\d)", "minus ", text)
        text = re.sub(r"(?<=\d)\s?~\s?(?=\d)", " to ", text)  # "5~10 minutes": a range
        text = re.sub(r"(?<![\w.])(\d+(?:\.\d+)?)[eE]([-+]?)(\d+)(?![\w.])",  # "1e6", "2.5e-3": scientific notation
                      lambda m: f"{m.group(1)} times 10 to the power of {'minus ' if m.group(2) == '-' else ''}{m.group(3)}", text)
        text = re.sub(r"(?<![\w.])([1-9]\d*(?:\.\d+)?)\s?x\s?(\d+(?:\.\d+)?)(?![\w.])",  # "3 x 4": counts, not years
                      lambda m: f"{cardinal(m.group(1))} by {cardinal(m.group(2))}", text)
        text = re.sub(r"(?<![\w.])(\d+(?:\.\d+)?|\.\d+)x(?=\s+[a-z]|[,.;:!?)\]]+(?:\s|$)|$)", _multiplier, text)
        return re.sub(r"(?<=\d)\s?\*\s?(?=\d)", " times ", text)

    # -- abbreviations

    @staticmethod
    def _abbreviations(text: str) -> str:
        def title(m):
            return TITLES[m.group(0)]

        keys = sorted(TITLES, key=len, reverse=True)
        text = re.sub(r"(?<![\w.])(?:" + "|".join(re.escape(t) for t in keys) + r")(?=\s)", title, text)
        text = re.sub(r"(?<![\w.])Ms(?=\s+[A-Z][a-z])", "Miz", text)  # British "Ms Smith" (espeak-ng spelled it "M-S")
        # initials before a name: "J. R. R. Tolkien", "Mister T. Smith" -> "J R R Tolkien" (the
        # sentence splitter cut after every one of them)
        text = re.sub(r"(?<![\w.])((?:[A-Z]\.\s+)+[A-Z])\.(?=\s+[A-Z][a-z])", lambda m: m.group(1).replace(".", ""), text)
        text = re.sub(r"\b((?:Mister|Missus|Miz|Doctor|Professor)\s+[A-Z])\.(?=\s+[A-Z][a-z])", r"\1", text)
        # "e.g.," / "i.e.:" (the comma is the usual style), "E.g." starting a sentence, and one ending the text
        def for_example(m):
            said = TITLES[m.group(1).lower()]
            return (said.capitalize() if m.group(1)[0].isupper() else said) + ("" if m.string[m.end():].strip() else ".")

        text = re.sub(r"(?<![\w.])([Ee]\.g\.|[Ii]\.e\.)(?=[\s,;:)\]]|$)", for_example, text)

        def saint_or_street(m):  # "Main St." (a capitalised word before, none after) is a street
            street = re.search(r"\b[A-Z][a-z]*\s+$", m.string[: m.start()]) and not re.match(r"\s+[A-Z]", m.string[m.end():])
            if street or not re.match(r"\s+[A-Z]", m.string[m.end():]):
                return "Street" + ("." if _sentence_end(m.string, m.end()) else "")
            return "Saint"

        text = re.sub(r"(?<![\w.])St\.", saint_or_street, text)

        def abbreviation(m):
            said = ABBREVIATIONS.get(m.group(1)) or ABBREVIATIONS[m.group(1)[0].lower() + m.group(1)[1:]].capitalize()
            return said + ("." if m.group(1).endswith(".") and _sentence_end(m.string, m.end()) else "")

        # "Approx. 5 people" starting a sentence too (it was left, and the splitter cut after it)
        keys = sorted([*ABBREVIATIONS, *(k[0].upper() + k[1:] for k in ABBREVIATIONS if k[0].islower() and k.endswith("."))],
                      key=len, reverse=True)
        text = re.sub(r"(?<![\w.])(" + "|".join(re.escape(k) for k in keys) + r")(?![\w])", abbreviation, text)
        wordlike = "|".join(re.escape(k) for k in WORDLIKE_ABBREVIATIONS)
        text = re.sub(rf"(?<![\w.])(?:{wordlike})(?=,|\s+(?:[a-z0-9]|{MONTH}\b))", lambda m: CALENDAR_ABBREVIATIONS[m.group(0)], text)
        text = re.sub(r"\b[Nn]o\.\s*(?=\d)", "number ", text)
        def numbered(m):  # "Fig. 3" -> "Figure 3", "vol. 2" -> "volume 2"
            word = m.group(1)
            return (NUMBERED[word] if word in NUMBERED else NUMBERED[word.capitalize()].lower()) + " "

        lower = [k.lower() for k in NUMBERED if not k.islower()]
        text = re.sub(r"\b(" + "|".join([*NUMBERED, *lower]) + r")\.\s*(?=\d)", numbered, text)
        text = re.sub(r"\bWW(III|II|I|[123])\b",  # was "wwii", "wwiii"
                      lambda m: "World War " + cardinal(str(roman_value(m.group(1)) if m.group(1).isalpha() else m.group(1))), text)
        text = re.sub(r"\bN\u00b0\s?(?=\d)", "number ", text)  # the numero sign written "N° 5" (was "N degrees five")
        return re.sub(r"#\s?(?=\d)", "number ", text)

    # -- numbers in context

    @staticmethod
    def _phones(text: str) -> str:
        def phone(m):
            groups = [g for g in re.split(r"[^\d+]+", m.group(0)) if g]
            return ", ".join(("plus " + digits(g)) if g.startswith("+") else digits(g) for g in groups)

        text = re.sub(r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{3}\)\s?|\d{3}[\s.-])\d{3}[\s.-]\d{4}(?![\w])", phone, text)
        text = re.sub(r"(?<![\w+])\+\d{1,3}(?:[\s.-]?\d{2,4}){2,5}(?![\w])", phone, text)
        text = re.sub(r"(?<![\w,.-])\d{3}-\d{4}(?![\w-])", phone, text)
        # a service number after "call" / "dial": "call 911" -> "call nine one one"
        text = re.sub(rf"\b((?:call|dial|ring)(?:s|ed|led|ing|ling)?\s+)({'|'.join(SERVICE_NUMBERS)})(?!\d)",
                      lambda m: m.group(1) + digits(m.group(2)), text, flags=re.IGNORECASE)
        # capital letters and three or more digits: a code ("BA2490", "RTX4090"), its digits one by one
        text = re.sub(r"\b([A-Z]{1,3})(\d{3,})\b", lambda m: f"{m.group(1)} {digits(m.group(2))}", text)
        # a leading zero, or 8 or more digits: an identifier, read digit by digit
        return re.sub(r"(?<![\w.,])(?:0\d+|\d{8,})(?![\w]|[.,]\d)", lambda m: digits(m.group(0)), text)

    @staticmethod
    def _rates(text: str) -> str:
        """A slash between an amount and a word is "per": "$5/month" -> "$5 per month", "60/min" ->
        "60 per minute" (:data:`RATE_UNITS`), not "or"."""
        return re.sub(rf"(?<![\w.,/])({SIGN}?(?:{NUMBER})(?:k|m|bn)?)\s?/\s?([A-Za-z]+)\b",
                      lambda m: f"{m.group(1)} per {RATE_UNITS.get(m.group(2), m.group(2))}", text)

    @staticmethod
    def _currency(text: str) -> str:
        """"$49.99", "€3.50", "$1.2 million", "$20-$30" read out; a sign or ISO code after the number
        ("5€", "5 USD") or a code before it ("USD 5") read as the sign before it; "10¢" -> "ten cents"."""
        def money(m):
            sign, number, scale = m.group(1), m.group(2), m.group(3)
            unit, units, sub, subs = CURRENCIES[sign]
            if scale:
                return f"{cardinal(number)} {SCALES[scale.lower()]} {units}"
            whole, _, cents = number.replace(",", "").partition(".")
            if sub is None or not cents or len(cents) != 2:
                return f"{cardinal(number)} {unit if _is_one(number) else units}"
            said = [] if int(whole or 0) == 0 and int(cents) else [f"{cardinal(whole or '0')} {unit if whole == '1' else units}"]
            if int(cents):
                said.append(f"{cardinal(str(int(cents)))} {sub if int(cents) == 1 else subs}")
            return " and ".join(said)

        scale = r"(?:\s?(thousand|million|billion|trillion|k|m|mn|bn|b|tn)\b)?"
        text = re.sub(r"(£\s?\d+\.\d\d)p\b", r"\1", text)  # "£2.50p": the pence are said once
        # "$20-$30", "$20-30": a range of amounts
        codes = "|".join(CURRENCY_CODES)
        text = re.sub(rf"\b({codes})\s?(?={NUMBER})", lambda m: CURRENCY_CODES[m.group(1)], text)  # "USD 5"
        text = re.sub(rf"(?<![\w.,])({NUMBER})\s?(?:({SIGN})|({codes})\b)(?!\s?\d)",  # "5€", "5 USD": the sign first
                      lambda m: (m.group(2) or CURRENCY_CODES[m.group(3)]) + m.group(1), text)
        text = re.sub(rf"(?<![\w.,])({NUMBER})\s?¢", lambda m: f"{cardinal(m.group(1))} {'cent' if _is_one(m.group(1)) else 'cents'}",
                      text)
        text = re.sub(rf"({SIGN})(" + NUMBER + rf")\s?[-\u2013]\s?{SIGN}?(" + NUMBER + r")(?!\d)", r"\1\2 to \1\3", text)
        amount = rf"({SIGN})\s?(" + NUMBER + r")(?!\d)" + scale

        def prefixed(m):  # "US$5" -> "five U-S dollars" (it was "USfive dollars")
            said = re.sub(amount, money, m.group(2), flags=re.IGNORECASE)
            return re.sub(r"\b(dollars?)\b", rf"{DOLLAR_PREFIXES[m.group(1)]} \1", said, count=1)

        text = re.sub(rf"\b(?-i:({'|'.join(DOLLAR_PREFIXES)}))(\${amount[len(f'({SIGN})'):]})", prefixed, text,
                      flags=re.IGNORECASE)
        text = re.sub(rf"(?<=[A-Za-z])(?={SIGN}\s?\.?\d)", " ", text)  # other letters stuck to a sign: a word of their own
        return re.sub(amount, money, text, flags=re.IGNORECASE)

    @staticmethod
    def _times(text: str) -> str:
        meridian = r"(?:\s?([AaPp])\.?\s?[Mm]\b\.?)"

        def said(hour: int, minute: int, half: str | None, m) -> str:
            words = cardinal(str(hour))
            if minute == 0:
                words += "" if half else " o'clock"
            else:
                words += " " + ("oh " + cardinal(str(minute)) if minute < 10 else cardinal(str(minute)))
            if half:
                words += " " + half.upper() + "-M"
                if m.group(0).endswith(".") and _sentence_end(m.string, m.end()):
                    words += "."
            return words

        def clock(m):
            hour, minute = int(m.group(1)), int(m.group(2))
            if hour > 24 or minute > 59 or (m.group(4) and not 1 <= hour <= 12):
                return m.group(0)
            if hour % 24 == 0 and minute == 0 and not m.group(3) and not m.group(4):
                return "midnight"  # "00:00", "24:00", not "zero o'clock"
            words = said(hour, minute, m.group(4), m)
            return words if m.group(3) is None else words + " and " + cardinal(str(int(m.group(3)))) + " seconds"

        def hour_only(m):
            hour = int(m.group(1))
            return said(hour, 0, m.group(2), m) if 1 <= hour <= 12 else m.group(0)

        # "noon-1pm", "10am-noon", "10:30-midnight": "to" (it was "noon-one P-M")
        text = re.sub(rf"\b(noon|midnight)\s?[-\u2013]\s?(?={TIME})", r"\1 to ", text, flags=re.IGNORECASE)
        text = re.sub(rf"(?<![\w.])({TIME})\s?[-\u2013]\s?(?=(?:noon|midnight)\b)", r"\1 to ", text, flags=re.IGNORECASE)
        text = _ranges_before(text, r"\d{1,2}(?::\d{2})?", r"[AaPp]\.?\s?[Mm]\b")  # "3-4 pm", "2:30-3:30 pm"
        text = _ranges_before(text, r"\d{1,2}:\d{2}", r"(?![\d:])")  # "2:30-3:30"
        text = re.sub(r"(?<![\w.])(\d{1,2})\.(\d{2})(?=\s?[AaPp]\.?\s?[Mm]\b)", r"\1:\2", text)  # "7.30pm"
        text = re.sub(r"\b(\d{1,2}):(\d{2})(?::(\d{2}))?" + meridian + r"?(?![\d:])", clock, text)
        return re.sub(r"\b(\d{1,2})" + meridian + r"(?![A-Za-z])", hour_only, text)

    @staticmethod
    def _dates(text: str) -> str:
        def numeric(m):
            a, b, y = int(m.group(1)), int(m.group(2)), m.group(3)
            month, day = (a, b) if a <= 12 else (b, a)
            if not (1 <= month <= 12 and 1 <= day <= 31):
                return m.group(0)
            full = int(y) if len(y) == 4 else (2000 + int(y) if int(y) < 50 else 1900 + int(y))
            return f"{MONTHS[month - 1]} {ordinal(day)}, {year(full)}"

        def iso(m):
            y, month, day = int(m.group(1)), int(m.group(2)), int(m.group(3))
            if not (1 <= month <= 12 and 1 <= day <= 31):
                return m.group(0)
            return f"{MONTHS[month - 1]} {ordinal(day)}, {year(y)}"

        def month_day(m):
            day = int(m.group(2))
            if not 1 <= day <= 31:
                return m.group(0)
            said = f"{MONTH_NAMES[m.group(1).lower().rstrip('.')]} {ordinal(day)}"
            return said + (f", {year(int(m.group(4)))}" if m.group(4) else "")

        def day_month(m):
            day = int(m.group(1))
            if not 1 <= day <= 31:
                return m.group(0)
            the = "" if re.search(r"\bthe\s+$", m.string[: m.start()], re.IGNORECASE) else "the "
            said = f"{the}{ordinal(day)} of {MONTH_NAMES[m.group(2).lower()]}"
            return said + (f", {year(int(m.group(3)))}" if m.group(3) else "")

        text = re.sub(r"(?<![\d/])(\d{1,2})/(\d{1,2})/(\d{4}|\d{2})(?![\d/])", numeric, text)
        text = re.sub(r"(?<![\d-])(\d{4})-(\d{2})-(\d{2})(?![\d-])", iso, text)
        text = re.sub(r"(?<![\d/])(\d{4})/(\d{1,2})/(\d{1,2})(?![\d/])", iso, text)  # "2026/12/02" (was "slash")
        text = re.sub(r"\b(" + MONTH + r")\.?\s+(\d{1,2})(?:st|nd|rd|th)?\b(?!:|\.\d|,\d)(?:(,)?\s+(\d{4})\b)?", month_day, text)
        return re.sub(r"\b(\d{1,2})(?:st|nd|rd|th)?\s+(?:of\s+)?(" + MONTH + r")\b(?:,?\s+(\d{4})\b)?", day_month, text)

    @staticmethod
    def _units(text: str) -> str:
        keys = sorted(UNITS, key=len, reverse=True)

        def unit(m):
            number, name = m.group(1), m.group(2)
            singular, plural = UNITS[name]
            return f"{cardinal(number)} {singular if _is_one(number) else plural}"

        names = "|".join(re.escape(k) for k in keys)
        text = _ranges_before(text, f"(?:{NUMBER})", f"(?:{names})(?![A-Za-z0-9°])")  # "5-10 km"
        def feet_inches(m):  # 6'2", 5' 11", 5'11 (inches 0-11)
            inches = m.group(2) or m.group(3)
            if int(inches) > 11:
                return m.group(0)
            return (f"{cardinal(m.group(1))} {'foot' if m.group(1) == '1' else 'feet'} "
                    f"{cardinal(inches)} {'inch' if inches == '1' else 'inches'}")

        text = re.sub(rf"(?<![\w.'\u2019])(\d){FOOT}(?:\s?(\d{{1,2}}){INCH}(?!\w)|(\d{{1,2}})(?![\w'\u2019\u2032\"]|\.\d))",
                      feet_inches, text)
        text = re.sub(rf"(?<![\w.'\u2019/])({NUMBER}){FOOT}(?![\w'\u2019\u2032])", _mark_unit("'", "foot", "feet"), text)
        text = re.sub(rf"(?<![\w.'\"/])({NUMBER}){INCH}(?![\w'\"])", _mark_unit('"', "inch", "inches"), text)
        # a fraction of an inch or a foot: '3/4"' -> "three quarters of an inch", '3/2"' -> "three halves inches"
        text = re.sub(rf"(?<![\w.'\"/])(\d+)/([2-9]|1[0-6]|32|64)({INCH}|{FOOT})(?![\w'\"\u2019\u2032])", _fraction_of_unit, text)
        per_names = "|".join(re.escape(k) for k in sorted({*UNITS, *RATE_UNITS}, key=len, reverse=True))

        def compound(m):  # "20 m/s" -> "twenty meters per second" (the slash was read "or")
            per = m.group(3)
            return f"{unit(m)} per {UNITS[per][0] if per in UNITS else RATE_UNITS[per]}"

        text = re.sub(r"(?<![\w.])(-?(?:" + NUMBER + r"))\s?(" + names + r")/(" + per_names + r")(?![A-Za-z0-9°/])",
                      compound, text)
        pattern = (r"(?<![\w.])(-?(?:" + NUMBER + r"))\s?(" + names + r")(?![A-Za-z0-9°])")
        text = re.sub(pattern, unit, text)
        return re.sub(r"(?<=\b(?:feet|foot) )(\d{1,2})\s?in\b",  # "5 ft 10 in": "in" only after feet
                      lambda m: f"{cardinal(m.group(1))} {'inch' if m.group(1) == '1' else 'inches'}", text)

    @staticmethod
    def _percentages(text: str) -> str:
        text = _ranges_before(text, f"(?:{NUMBER})", "%")  # "10-20%", "10%-20%"
        return re.sub(r"(?<![\w.])(-?(?:" + NUMBER + r"))\s?%", lambda m: cardinal(m.group(1)) + " percent", text)

    @staticmethod
    def _ordinals(text: str) -> str:
        ordinal_ = r"\d+(?:st|nd|rd|th)"  # "1st-2nd" -> "1st to 2nd" (was "first-second")
        text = re.sub(rf"(?<![\w.,-])({ordinal_})\s?[-\u2013]\s?(?={ordinal_}\b)", r"\1 to ", text, flags=re.IGNORECASE)
        return re.sub(r"\b(\d{1,3}(?:,\d{3})+|\d+)(?:st|nd|rd|th)\b",  # "1,000th" too (was "one, zeroth")
                      lambda m: ordinal(int(m.group(1).replace(",", ""))), text, flags=re.IGNORECASE)

    @staticmethod
    def _decades(text: str) -> str:
        text = re.sub(r"\b(1[1-9]\d0|20\d0)'?s\b", lambda m: plural_words(year(int(m.group(1)))), text)
        text = re.sub(r"(?<!\w)['\u2019]([2-9]0)s\b", lambda m: plural_words(cardinal(m.group(1))), text)
        # "the 90s", "in her 20s", "the mid-80s": a decade or an age without its apostrophe after a
        # word that leaves no other reading ("10s" alone may be ten seconds)
        text = re.sub(r"\b((?:the|his|her|their|my|your|our|early|mid|late)[ -])([1-9]0)['\u2019]?s\b",
                      lambda m: m.group(1) + plural_words(cardinal(m.group(2))), text, flags=re.IGNORECASE)
        # a name's number in the plural: "MP3s" -> "MP threes", "F1s" -> "F ones" (was "three s")
        text = re.sub(r"(?<=[A-Za-z])(\d{1,3})s\b", lambda m: " " + plural_words(cardinal(m.group(1))), text)
        # what is left of "Ns": "10s of people" -> "tens of people" (:data:`MULTIPLES_OF`); "90s music"
        # a decade (a lower-case word not in :data:`AFTER_SECONDS` after it); else seconds: "wait 10s"
        multiples = "|".join(re.escape(k) for k in MULTIPLES_OF)
        text = re.sub(rf"(?<![\w.,'])({multiples})s(?=\s+of\b)", lambda m: MULTIPLES_OF[m.group(1)], text)
        text = re.sub(r"(?<![\w.,'-])([2-9]0)s(?=\s+([a-z]+)\b)",
                      lambda m: m.group(0) if m.group(2) in AFTER_SECONDS else plural_words(cardinal(m.group(1))), text)
        return re.sub(rf"(?<![\w.,'])({NUMBER})s\b(?!['\u2019])",
                      lambda m: f"{m.group(1)} {'second' if _is_one(m.group(1)) else 'seconds'}", text)

    @staticmethod
    def _ranges(text: str) -> str:
        """"10-20" -> "10 to 20"; "3:2" (not a time) -> "3 to 2"; "2.0.1" -> "2 point 0 point 1"."""
        text = re.sub(r"(?<![\w.])(\d+):(\d+)(?![\w:])", r"\1 to \2", text)
        text = re.sub(r"(?<![\w.])[vV](?=\d+(?:\.\d+)+(?!\w|\.\w))", "version ", text)  # "v2.0.1", "v3.1"
        text = re.sub(r"(?<![\w.])\d+(?:\.\d+){2,}(?!\w|\.\w)", lambda m: m.group(0).replace(".", " point "), text)
        return re.sub(r"(?<![\w.,-])(" + NUMBER + r")\s?[-\u2013]\s?(" + NUMBER + r")(?![\w-])",
                      r"\1 to \2", text)

    @staticmethod
    def _years(text: str) -> str:
        """A bare 1100-2099 is a year ("in 1999", "1999 was"), but a count where a price word comes
        before it ("paid 1999") or a plural follows it without a year word before it ("there were
        1999 people", "1500 dollars"; not "in 1999 prices", "the 2020 elections"): :data:`COUNT_BEFORE`,
        :data:`YEAR_BEFORE`, :data:`NOT_PLURALS`, :data:`IRREGULAR_PLURALS`."""
        def number(m):
            before = re.search(r"([A-Za-z]+)\W*\s+$", m.string[max(0, m.start() - 30): m.start()])  # the word before
            after = re.match(r"\s+([a-z]+)\b", m.string[m.end():])
            previous, following = (before.group(1).lower() if before else ""), (after.group(1) if after else "")
            plural = following in IRREGULAR_PLURALS or (following.endswith("s") and following not in NOT_PLURALS)
            count = previous in COUNT_BEFORE or (plural and previous not in YEAR_BEFORE)
            return cardinal(m.group(1)) if count else year(int(m.group(1)))

        return re.sub(r"(?<![\w.,])(1[1-9]\d\d|20\d\d)(?![\w]|[.,]\d)", number, text)

    @staticmethod
    def _fractions(text: str) -> str:
        """"a/b" without a year: a date, a fraction or two numbers, by :func:`slash_reading`; "2 3/4"
        -> "two and three quarters", "1 1/2" -> "one and a half"."""
        def mixed(m):
            part = fraction(int(m.group(2)), int(m.group(3)))
            return f"{cardinal(m.group(1))} and {'a' if part.startswith('one ') else part.split()[0]} {part.split()[-1]}"

        def slash(m):
            before = m.string[: m.start()]
            return slash_reading(int(m.group(1)), int(m.group(2)), re.search(DATE_CONTEXT, before, re.IGNORECASE) is not None)

        text = re.sub(r"(?<![\w/.,])(\d+)\s(\d{1,2})/([2-9]|1\d)(?![\w/])", mixed, text)
        return re.sub(r"(?<![\w/.])(\d{1,2})/(\d{1,2})(?![\w/])", slash, text)

    @staticmethod
    def _numbers(text: str) -> str:
        """What is left: "-5" -> "minus 5", "100k", "5M", "2bn" -> "100 thousand", ... (not "4K", a
        resolution), then every number as a cardinal."""
        text = re.sub(r"(?<![\w.])-(?=\.?\d)", "minus ", text)
        text = re.sub(rf"(?<![\w.])({NUMBER})(k|M|B|mn|bn)\b", lambda m: f"{m.group(1)} {SCALES[m.group(2).lower()]}", text)
        return re.sub(NUMBER, lambda m: " " + cardinal(m.group(0)) + " ", text)

    # -- words

    @staticmethod
    def _roman(text: str) -> str:
        """A Roman numeral of two letters or more after a capitalised word: "the second" after a
        name of :data:`REGNAL_NAMES` ("Elizabeth II", "Louis XIV"), else the number ("World War
        II", "Rocky IV"); not spelled. "I" alone stays the pronoun."""
        def numeral(m):
            value = None if m.group(2) in NOT_ROMAN else roman_value(m.group(2))
            if value is None:
                return m.group(0)
            said = f"the {ordinal(value)}" if m.group(1) in REGNAL_NAMES else cardinal(str(value))
            return f"{m.group(1)} {said}"

        text = re.sub(r"\bWorld War I\b", "World War one", text)  # a lone "I" is the pronoun elsewhere
        return re.sub(r"\b([A-Z][a-z]+)\s+([IVXL]{2,})\b", numeral, text)

    @staticmethod
    def _initialisms(text: str) -> str:
        def spelled(letters: str) -> str:
            return "-".join(letters)

        def dotted(m):  # U.S., U.S.A., U.K.: the last period ends a sentence only at the end of a line
            rest = m.string[m.end():]
            return spelled(m.group(0).replace(".", "")) + ("." if not rest.strip() or rest.startswith("\n") else "")

        def capitals(m):
            word, plural = m.group(1), m.group(2) or ""
            if word in SPOKEN_WORDS and not plural:
                return SPOKEN_WORDS[word]
            if word in ACRONYMS_AS_WORDS:
                return word.capitalize() + plural
            if word in ACRONYMS_SPELLED:
                return spelled(word) + ("'s" if plural else "")
            if word in SHORT_WORDS and not plural and (word not in SHORT_INITIALISMS or shouting(m)):
                return word.lower() if word not in ("I", "A") else word
            if len(word) <= 3 or not re.search(r"[AEIOU]", word):
                return spelled(word) + ("'s" if plural else "")
            return word.lower() + plural

        def shouting(m):  # the line has no lower-case letter, or a word next to this one is all capitals
            line = m.string.split("\n")[m.string.count("\n", 0, m.start())]
            column = m.start() - (m.string.rfind("\n", 0, m.start()) + 1)
            before, after = re.findall(r"[A-Za-z']+", line[:column]), re.findall(r"[A-Za-z']+", line[column + len(m.group(0)):])
            return not re.search("[a-z]", line) or any(w.isupper() and w != "A" for w in before[-1:] + after[:1])

        text = re.sub(r"\b([A-Z]{1,3})&([A-Z]{1,3})\b", lambda m: f"{spelled(m.group(1))} and {spelled(m.group(2))}", text)  # AT&T
        for written, said in SPOKEN_WORDS.items():
            if not written.isupper():
                text = re.sub(rf"\b{re.escape(written)}\b", said, text)
        text = re.sub(r"(?<![\w.])(?:[A-Z]\.){2,}", dotted, text)
        return re.sub(r"\b([A-Z]{2,})(s)?\b", capitals, text)

    @staticmethod
    def _symbols(text: str) -> str:
        # "C#", "F# minor", "A#m" (was "C hash", "Ahashtag m")
        text = re.sub(r"\b([A-G])#(m\b)?(?![\w#])", lambda m: f"{m.group(1)} sharp" + (" minor" if m.group(2) else ""), text)
        text = re.sub(r"#(?=[A-Za-z])", "hashtag ", text)
        text = re.sub(r"\band/or\b", "and or", text)
        text = re.sub(r"(?<=[A-Za-z])/(?=[A-Za-z])", " or ", text)
        text = re.sub(r"\b(about|around|approximately|roughly|circa)\s?~\s?", r"\1 ", text)  # "about~20": said once
        text = re.sub(r"~\s?(?=\w)", " about ", text)
        for symbol, said in (("&", "and"), ("@", "at"), ("+", "plus"), ("=", "equals"), ("×", "times"),
                             ("÷", "divided by"), ("<", "less than"), (">", "greater than"), ("/", "slash"),
                             ("#", "hash"), ("%", "percent"), ("°", "degrees"), ("§", "section"), ("¶", "paragraph"),
                             ("‰", "per mille"), ("\\", "backslash"), ("†", "dagger"),
                             ("±", "plus or minus"), ("≈", "approximately"), ("≤", "less than or equal to"),
                             ("≥", "greater than or equal to"), ("≠", "not equal to"), ("∞", "infinity")):
            text = text.replace(symbol, f" {said} ")
        return text
