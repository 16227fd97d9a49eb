"""What a wheel (``pip install .``, not the README's editable install from a clone) carries and
says: every file the package reads at run time is package data, and without the clone's
``models/`` or ``pipelines/`` the commands say so in one line instead of "train it"."""

import fnmatch
import subprocess
import tomllib
from pathlib import Path

import pytest

from mmspec.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_every_file_the_package_reads_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    tracked = subprocess.run(["git", "ls-files", "mmspec"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    missing = []
    for name in tracked:
        if name.endswith(".py"):
            continue
        path = Path(name)
        shipped = any(path.is_relative_to(Path(*package.split("."))) and
                      any(fnmatch.fnmatch(path.relative_to(Path(*package.split("."))).as_posix(), pattern) for pattern in patterns)
                      for package, patterns in data.items())
        if not shipped:
            missing.append(name)
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
    assert any(name.endswith(".c") for name in tracked)  # (the C kernels: what a wheel lacked)


@pytest.mark.parametrize("argv", [["tts", "hi", "--out", "OUT/x.wav"], ["caption", "samples/photo.png"],
                                  ["t2i", "a red circle", "--out", "OUT/images"]])
def test_without_the_models_folder_the_embedded_defaults_say_how_to_install(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMSPEC_MODELS_DIR", str(tmp_path / "models"))  # as a wheel's: no such folder
    monkeypatch.chdir(ROOT)
    argv = [a.replace("OUT", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no models/ folder" in err and "bash scripts/install.sh" in err
    assert "MMSPEC_MODELS_DIR" in err and "train" not in err


def test_with_the_folder_but_not_the_model_the_message_names_the_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "models").mkdir()
    monkeypatch.setenv("MMSPEC_MODELS_DIR", str(tmp_path / "models"))
    assert main(["tts", "hi", "--out", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err
    assert "not in this checkout" in err and "has no models/ folder" not in err


def test_without_the_pipelines_folder_presets_say_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMSPEC_PIPELINES_DIR", str(tmp_path / "pipelines"))
    assert main(["run", "caption-gemma4", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "has no pipelines/ folder" in err and "MMSPEC_PIPELINES_DIR" in err
