"""``charts`` family (ChartQA-like): bar, horizontal bar, line and pie charts with 2-5 categories.

Values are integers and every value is printed on the chart, so each question is answerable by
reading.  Charts are drawn with matplotlib's Agg canvas directly (no pyplot, no global backend
or rcParams changes) on one reused figure per output size.

Content key: chart type, theme, categories and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from .core import QA, Content, capitalize, draw_for_split, join_words, number_word, pick, sentence, yes_no


@dataclass(frozen=True)
class Theme:
    title: str
    categories: tuple[str, ...]
    ordered: bool  # categories form a sequence (days, months, years): lines make sense
    noun: str  # what a category is, for questions ("Which fruit ...")
    max_upright: int = 5  # most categories whose labels fit side by side under vertical bars


THEMES = (
    Theme("Fruit sales", ("Apple", "Pear", "Plum", "Kiwi", "Lime", "Fig", "Peach", "Mango", "Grape", "Lemon"),
          False, "fruit"),
    Theme("Daily visitors", ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"), True, "day"),
    Theme("Monthly rainfall", ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"),
          True, "month"),
    Theme("Test scores", ("Ann", "Bob", "Cara", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivy", "Jack"), False,
          "student"),
    Theme("Favorite colors", ("Red", "Blue", "Green", "Pink", "Gold", "Gray"), False, "color"),
    Theme("Club members", ("Golf", "Polo", "Judo", "Ski", "Swim", "Rugby", "Chess"), False, "club"),
    Theme("Yearly profit", ("2019", "2020", "2021", "2022", "2023", "2024"), True, "year", 4),
    Theme("Pets owned", ("Cats", "Dogs", "Fish", "Birds", "Mice"), False, "pet"),
    Theme("Group sizes", ("A", "B", "C", "D", "E", "F"), False, "group"),
)
CHART_TYPES = ("bar", "hbar", "line", "pie")
CHART_NAMES = {"bar": "bar chart", "hbar": "horizontal bar chart", "line": "line chart", "pie": "pie chart"}
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass(frozen=True)
class ChartSpec:
    kind: str
    theme: Theme
    categories: tuple[str, ...]
    values: tuple[int, ...]  # percentages summing to 100 for pies

    @property
    def unit(self) -> str:
        return "%" if self.kind == "pie" else ""


def _values(rng: np.random.Generator, k: int, pie: bool) -> tuple[int, ...]:
    """``k`` distinct integers (1-99), or distinct percentages >= 6 summing to 100 for pies."""
    while True:
        if pie:
            weights = rng.dirichlet(np.full(k, 2.0))
            vals = np.maximum(6, np.round(weights * 100)).astype(int)
            vals[np.argmax(vals)] += 100 - vals.sum()
        else:
            vals = rng.integers(1, 100, size=k)
        if len(set(vals.tolist())) == k and vals.min() >= (6 if pie else 1):
            return tuple(int(v) for v in vals)


def _draw_spec(rng: np.random.Generator) -> tuple[str, ChartSpec]:
    kind = pick(rng, CHART_TYPES)
    themes = [t for t in THEMES if t.ordered == (kind == "line")] if kind in ("line", "pie") else THEMES
    theme = pick(rng, themes)
    k = int(rng.integers(2 if kind != "line" else 3, 6))
    k = min(k, len(theme.categories), theme.max_upright if kind in ("bar", "line") else 5)
    if theme.ordered:
        start = int(rng.integers(len(theme.categories) - k + 1))
        cats = theme.categories[start:start + k]
    else:
        idx = np.sort(rng.choice(len(theme.categories), size=k, replace=False))
        cats = tuple(theme.categories[i] for i in idx)
    spec = ChartSpec(kind, theme, cats, _values(rng, k, kind == "pie"))
    return f"chart|{kind}|{theme.title}|{','.join(cats)}|{','.join(map(str, spec.values))}", spec


class _ChartRenderer:
    """One reused matplotlib Figure + Agg canvas for a given output size."""

    def __init__(self, size: int):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.size = size
        self.dpi = 100
        self.figure = Figure(figsize=(size / self.dpi, size / self.dpi), dpi=self.dpi)
        self.canvas = FigureCanvasAgg(self.figure)
        self.fs = 7.0 * size / 128  # font size in points (~10 px at 128 px)

    def _pie(self, spec: ChartSpec, colors: list[str], rng: np.random.Generator) -> None:
        """Pie with category names outside; percentages inside big slices, outside small ones."""
        fs = self.fs * 0.95
        ax = self.figure.add_axes((0.0, 0.0, 1.0, 0.86))
        wedges, _ = ax.pie(spec.values, colors=colors, startangle=float(rng.choice([0, 90])), counterclock=False,
                           wedgeprops={"linewidth": 0.8, "edgecolor": "white"})
        for wedge, cat, v in zip(wedges, spec.categories, spec.values):
            mid = np.radians((wedge.theta1 + wedge.theta2) / 2)
            c, s = np.cos(mid), np.sin(mid)
            inside = v >= 15
            ha = "left" if c > 0.2 else "right" if c < -0.2 else "center"
            va = "bottom" if s > 0.2 else "top" if s < -0.2 else "center"
            ax.text(1.1 * c, 1.1 * s, cat if inside else f"{cat} {v}%", fontsize=fs, ha=ha, va=va)
            if inside:
                ax.text(0.6 * c, 0.6 * s, f"{v}%", fontsize=fs, ha="center", va="center", color="white",
                        fontweight="bold")
        ax.set_xlim(-2.1, 2.1)
        ax.set_ylim(-1.75, 1.75)
        ax.set_aspect("equal")
        ax.set_axis_off()

    def _axes(self, rect: tuple[float, float, float, float], hide: str):
        """Axes without a frame on top/right/``hide`` and without tick marks."""
        ax = self.figure.add_axes(rect)
        ax.set_facecolor("none")
        for side in ("top", "right", hide):
            ax.spines[side].set_visible(False)
        ax.tick_params(length=0, pad=1)
        return ax

    def _bar(self, spec: ChartSpec, colors: list[str], rng: np.random.Generator) -> None:
        x, vmax, fs = np.arange(len(spec.values)), max(spec.values), self.fs
        if spec.kind == "bar":
            ax = self._axes((0.06, 0.17, 0.9, 0.67), "left")
            bars = ax.bar(x, spec.values, color=colors, width=0.65)
            ax.set_xticks(x, spec.categories, fontsize=fs)
            ax.set_ylim(0, vmax * 1.22)
            ax.set_yticks([])
        else:
            ax = self._axes((0.25, 0.16, 0.71, 0.68), "bottom")
            bars = ax.barh(x, spec.values, color=colors, height=0.65)
            ax.set_yticks(x, spec.categories, fontsize=fs)
            ax.set_xlim(0, vmax * 1.3)
            ax.set_xticks([])
            ax.invert_yaxis()
        ax.bar_label(bars, fontsize=fs, padding=1)

    def _line(self, spec: ChartSpec, colors: list[str], rng: np.random.Generator) -> None:
        x, vmax, fs, k = np.arange(len(spec.values)), max(spec.values), self.fs, self.size / 128
        ax = self._axes((0.06, 0.17, 0.9, 0.67), "left")
        ax.plot(x, spec.values, color=colors[0], marker="o", markersize=3 * k, linewidth=1.5 * k)
        for xi, v in zip(x, spec.values):
            ax.annotate(str(v), (xi, v), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=fs)
        ax.set_xticks(x, spec.categories, fontsize=fs)
        ax.set_xlim(-0.4, len(x) - 0.6)
        ax.set_ylim(0, vmax * 1.25)
        ax.set_yticks([])

    def render(self, spec: ChartSpec, rng: np.random.Generator) -> Image.Image:
        """Draw ``spec`` (colours and small style choices from ``rng``) and return the RGB image."""
        fig = self.figure
        fig.clf()
        fig.set_facecolor(pick(rng, ["white", "#f7f7f2", "#eef3f8"]))
        n = len(spec.values)
        if spec.kind != "pie" and rng.random() < 0.5:  # one colour for all bars
            colors = [PALETTE[int(rng.integers(len(PALETTE)))]] * n
        else:
            colors = [PALETTE[i] for i in rng.permutation(len(PALETTE))[:n]]
        {"pie": self._pie, "bar": self._bar, "hbar": self._bar, "line": self._line}[spec.kind](spec, colors, rng)
        fig.text(0.5, 0.975, spec.theme.title, ha="center", va="top", fontsize=self.fs * 1.1, fontweight="bold")
        self.canvas.draw()
        return Image.fromarray(np.asarray(self.canvas.buffer_rgba())[..., :3].copy())


_RENDERERS: dict[int, _ChartRenderer] = {}


def render_chart(spec: ChartSpec, rng: np.random.Generator, size: int) -> Image.Image:
    """Render ``spec`` as a ``size x size`` RGB image (reusing one figure per size)."""
    if size not in _RENDERERS:
        _RENDERERS[size] = _ChartRenderer(size)
    return _RENDERERS[size].render(spec, rng)


def _questions(rng: np.random.Generator, spec: ChartSpec) -> list[QA]:
    cats, vals, unit, noun = spec.categories, spec.values, spec.unit, spec.theme.noun
    i_max, i_min = int(np.argmax(vals)), int(np.argmin(vals))
    others = lambda i: [c for j, c in enumerate(cats) if j != i]  # noqa: E731
    num = lambda v: f"{v}{unit}"  # noqa: E731
    near = lambda v: [num(w) for w in (v - 10, v - 5, v + 5, v + 10) if w > 0]  # noqa: E731
    high = pick(rng, ["Which category has the highest value?", f"Which {noun} has the highest value?",
                      "Which category is the largest?"])
    low = pick(rng, ["Which category has the lowest value?", f"Which {noun} has the lowest value?",
                     "Which category is the smallest?"])
    k = int(rng.integers(len(cats)))
    value_q = f"What percentage does {cats[k]} represent?" if spec.kind == "pie" else \
        pick(rng, [f"What is the value of {cats[k]}?", f"What value does {cats[k]} have?"])
    diff = vals[i_max] - vals[i_min]
    qas = [QA(high, cats[i_max], others(i_max), "chart.max"),
           QA(low, cats[i_min], others(i_min), "chart.min"),
           QA(value_q, num(vals[k]), near(vals[k]), "chart.value"),
           QA("What is the difference between the highest and the lowest values?", num(diff), near(diff),
              "chart.diff"),
           QA(pick(rng, ["How many categories are shown?", "How many categories does the chart have?"]),
              str(len(cats)), [str(n) for n in range(2, 7) if n != len(cats)], "chart.count"),
           QA("What is the title of the chart?", spec.theme.title, [t.title for t in THEMES if t != spec.theme][:3],
              "chart.title"),
           QA("What type of chart is this?", capitalize(article_chart(spec.kind)),
              [capitalize(article_chart(t)) for t in CHART_TYPES if t != spec.kind], "chart.type")]
    if spec.kind != "pie":
        total = sum(vals)
        qas.append(QA("What is the sum of all the values?", str(total), near(total), "chart.sum"))
    a, b = (int(i) for i in rng.choice(len(cats), size=2, replace=False))
    qas.append(yes_no(f"Is the value of {cats[a]} greater than the value of {cats[b]}?", vals[a] > vals[b],
                      "chart.compare"))
    return qas


def article_chart(kind: str) -> str:
    """``"bar" -> "a bar chart"``."""
    return f"a {CHART_NAMES[kind]}"


def _captions(spec: ChartSpec) -> list[str]:
    name, title, unit = CHART_NAMES[spec.kind], spec.theme.title.lower(), spec.unit
    pairs = join_words([f"{c} {v}{unit}" for c, v in zip(spec.categories, spec.values)])
    i_max = int(np.argmax(spec.values))
    top = f"{spec.categories[i_max]} {'has the largest share' if spec.kind == 'pie' else 'is highest'}"
    caps = [f"A {name} of {title}: {pairs}.",
            f"A {name} showing {title} for {number_word(len(spec.values))} categories, where {top}."]
    if spec.kind == "line":
        caps.append(f"A line chart of {title} from {spec.categories[0]} to {spec.categories[-1]}, "
                    f"peaking at {spec.categories[i_max]}.")
    return [sentence(c) for c in caps]


def _detailed(spec: ChartSpec) -> str:
    cats, vals, unit = spec.categories, spec.values, spec.unit
    i_max, i_min = int(np.argmax(vals)), int(np.argmin(vals))
    pairs = join_words([f"{c} {v}{unit}" for c, v in zip(cats, vals)])
    text = (f'This is {article_chart(spec.kind)} titled "{spec.theme.title}" with {number_word(len(cats))} '
            f"categories, each labelled with its value: {pairs}. {cats[i_max]} has the highest value "
            f"({vals[i_max]}{unit}) and {cats[i_min]} the lowest ({vals[i_min]}{unit}).")
    if spec.kind == "line":
        trend = "rises" if vals[-1] > vals[0] else "falls"
        text += f" Overall the line {trend} from {cats[0]} to {cats[-1]}."
    return text


def generate(rng: np.random.Generator, split: str, size: int) -> Content:
    """One ``charts`` image; ``meta`` holds the chart type, categories and values."""
    key, spec = draw_for_split(rng, split, _draw_spec)
    image = render_chart(spec, rng, size)
    meta = {"key": key, "chart": spec.kind, "title": spec.theme.title, "categories": list(spec.categories),
            "values": list(spec.values)}
    return Content(image, _captions(spec), _detailed(spec), _questions(rng, spec), "chart", meta)
