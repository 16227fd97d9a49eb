"""Every ``mmspec ...`` command in a shell code block of the README, docs/ and the model cards parses
with the CLI as it stands (its subcommand, flags and choices exist), and every Python block there
compiles, its ``mmspec`` imports and ``mmspec.NAME`` attributes existing, and every dotted
``mmspec.a.b`` the pages name imports: a flag or a function renamed without its docs is an example
that fails for the reader who copies it. Parsing and imports only; nothing runs."""

import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

from mmspec.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "models").glob("*/README.md"))]


def code_blocks(text: str, languages: tuple[str, ...]):
    """(first line number, lines) of each ``` block of the page in one of ``languages``."""
    fence, language, lines, start = False, "", [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if fence and language in languages:
                yield start, lines
            fence, language, lines, start = not fence, line[3:].strip(), [], number + 1
        elif fence:
            lines.append(line)


def shell_lines(text: str):
    """(line number, command) of each shell command in the page's ``` / ```bash blocks, a
    backslash-newline joined as the shell joins it (removed, nothing in its place)."""
    for first, lines in code_blocks(text, ("", "bash", "sh")):
        pending = ""
        for number, line in enumerate(lines, first):
            if not pending:
                start = number
            pending += line
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            yield start, pending
            pending = ""


#: a call of mmspec: after environment assignments and a wrapper (taskset, nice, timeout, time, nohup,
#: ``accelerate launch ... -m``), ``mmspec`` or a path ending in it, then a subcommand
CALL = re.compile(r"(?:\w+=\S*\s+)*(?:(?:taskset -c|nice -n|timeout(?: -s \w+)?) \S+\s+|time\s+|nohup\s+|accelerate launch .*?-m\s+)?"
                  r"(?:\S*/)?mmspec\s+([a-z][\w-]*(?:\s.*)?)$")


def mmspec_commands(line: str):
    """The argument lists of the ``mmspec`` calls on a shell line (``&&``, ``;`` and pipes split
    it; a trailing ``&``, a redirection and a comment end one); None for a synopsis or a
    placeholder command (``[--flag ...]``, ``...``, ``$VAR``, ``<name>``) that is not meant to run as written."""
    for part in re.split(r"&&|\|\||;|\|", line):
        found = CALL.match(part.strip())
        if not found:
            continue
        rest = re.split(r"\s&\s*(?:#|$)|\s&$|\s\d?>", found.group(1))[0]
        if re.search(r"\[--|\.\.\.|\$|<", rest):
            yield None
            continue
        yield shlex.split(rest, comments=True)


def test_every_documented_command_parses():
    parser, failed, parsed = build_parser(), [], 0
    for page in PAGES:
        for number, line in shell_lines(page.read_text()):
            for argv in mmspec_commands(line):
                if argv is None:
                    continue
                errors = io.StringIO()
                try:
                    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                        parser.parse_args(argv)
                    parsed += 1
                except SystemExit as stop:
                    if stop.code:
                        failed.append(f"{page.relative_to(ROOT)}:{number}: mmspec {shlex.join(argv)}\n    {errors.getvalue().strip()}")
    assert not failed, "\n".join(failed)
    assert parsed > 150  # (the pages hold ~200: a scan that finds none checks nothing)


def test_the_scan_reads_commands_as_the_shell_does():
    page = ("text\n```\nHF_HUB_OFFLINE=1 .venv/bin/mmspec tts hi \\\n  --out a.wav && mmspec caption x.png > out.txt\n"
            "taskset -c 1 mmspec bench tts --methods ar,\\\nsjd &   # one per core\nmmspec serve [--port 8000]\n    mmspec run)\n"
            "  serve/   the mmspec command, the server\naccelerate launch --num_processes 2 -m mmspec caption d/\n```\n```python\nmmspec.pipeline()\n```\n")
    lines = list(shell_lines(page))
    assert [n for n, _ in lines] == [3, 5, 7, 8, 9, 10]
    found = [argv for _, line in lines for argv in mmspec_commands(line)]
    assert found == [["tts", "hi", "--out", "a.wav"], ["caption", "x.png"], ["bench", "tts", "--methods", "ar,sjd"], None,
                     ["caption", "d/"]]
    parser = build_parser()
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parser.parse_args(["tts", "hi", "--no-such-flag"])
        except SystemExit as stop:
            assert stop.code == 2
        else:
            raise AssertionError("a misspelt flag parsed")


def test_every_documented_python_block_compiles_and_its_mmspec_names_exist():
    import mmspec

    missing, blocks = [], 0
    for page in PAGES:
        for start, lines in code_blocks(page.read_text(), ("python",)):
            blocks += 1
            where = f"{page.relative_to(ROOT)}:{start}"
            try:
                tree = ast.parse("\n".join(lines))
            except SyntaxError as error:
                missing.append(f"{where}: {error}")
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mmspec":
                    module = importlib.import_module(node.module)
                    missing += [f"{where}: from {node.module} import {alias.name}" for alias in node.names
                                if not hasattr(module, alias.name) and not (hasattr(module, "__path__") and
                                                                            importlib.util.find_spec(f"{node.module}.{alias.name}"))]
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.split(".")[0] == "mmspec" and importlib.util.find_spec(alias.name) is None:
                            missing.append(f"{where}: import {alias.name}")
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "mmspec":
                    if not hasattr(mmspec, node.attr):
                        missing.append(f"{where}: mmspec.{node.attr}")
    assert not missing, "\n".join(missing)
    assert blocks > 20


#: dotted names that are not Python: the serving API's request field ``mmspec.compare_baseline``
#: (the ``compare_baseline`` key of a request's ``mmspec`` object, docs/serving.md)
NOT_PYTHON = {"mmspec.compare_baseline"}


def resolves(name: str) -> bool:
    """Whether a dotted ``mmspec.a.b.c`` names a module or an attribute of one (the longest prefix
    that imports, then attributes)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    for part in parts[cut:]:
        if not hasattr(found, part):
            return False
        found = getattr(found, part)
    return True


def test_every_dotted_mmspec_name_in_the_docs_exists():
    """A module, class or function the prose or a code block names by its dotted path
    (`mmspec.core.batch`, `mmspec.pipeline.from_preset`, `mmspec.api.generate_rows`) imports: a
    name moved or renamed without its docs sends the reader to nothing."""
    missing, names = [], 0
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for name in re.findall(r"(?<![\w./-])(mmspec(?:\.[A-Za-z_]\w*)+)", line):
                names += 1
                if name not in NOT_PYTHON and not resolves(name):
                    missing.append(f"{page.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "\n".join(missing)
    assert names > 200  # (the pages name ~290)
    assert not resolves("mmspec.core.no_such_module") and not resolves("mmspec.pipeline.no_such_method")
