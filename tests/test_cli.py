"""The mmspec command: help, errors without tracebacks, JSON output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmspec.cli import main


def test_help_as_module_and_console_script():
    console_script = str(Path(sys.executable).parent / "mmspec")  # installed beside this interpreter
    for command in ([sys.executable, "-m", "mmspec", "--help"], [console_script, "--help"]):
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        assert "generate" in done.stdout and "bench" in done.stdout


def test_empty_prompt_is_a_clear_error(capsys):
    assert main(["generate", "   ", "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "prompt is empty" in err and "Traceback" not in err


def test_unknown_drafter_is_a_clear_error(capsys):
    assert main(["generate", "hi", "--drafter", "layer-skip:99", "--dtype", "fp32"]) == 2
    assert "layer-skip needs 1 <= N < 30" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_json_with_baseline(capsys):
    code = main(["generate", "Repeat exactly: the red fox sleeps under the old oak tree.", "--dtype", "fp32",
                 "--max-new-tokens", "12", "--compare-baseline", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical_to_baseline"] is True
    assert result["stats"]["speedup"] > 0 and result["stats"]["method"] == "prompt-lookup"
    assert result["text"] == result["baseline_text"] and result["text"]


def test_unknown_drafter_name_is_a_clear_error(capsys):
    assert main(["generate", "hi", "--drafter", "nonsense", "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "unknown drafter 'nonsense'" in err and "Traceback" not in err
