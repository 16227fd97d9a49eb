"""Resumable training bookkeeping shared by every ``mmspec train`` recipe.

A recipe keeps its own model and optimizer; :class:`TrainingRun` keeps the rest: the step, the
log, the training time across restarts, the time limit, the atomically written checkpoint
(``OUT/train_state.pt``, never shipped) and ``OUT/training.json`` (arguments + log, for the model
card). Rerunning the same command resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "train_state.pt"


def train_device(args: Any) -> torch.device:
    """The device a recipe trains on: its ``--device`` (default cpu), checked to exist here. Random
    draws stay on the CPU's generators (a seed gives the same batches on every device); what they
    pick moves to the device."""
    from ..hub import resolve_device

    return resolve_device(getattr(args, "device", "cpu"))


def to_device(batch: Any, device: torch.device) -> Any:
    """A batch (a tensor, or a dict / tuple / list of them; other values such as None kept) with
    every tensor moved to ``device``."""
    if isinstance(batch, dict):
        return {name: to_device(value, device) for name, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch.to(device) if isinstance(batch, torch.Tensor) else batch


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """--device (:func:`train_device`)."""
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (batches are drawn on the CPU)")


def autocast(device: torch.device):
    """bf16 autocast where bf16 matmuls are fast on ``device`` (fp32 weights; :func:`mmspec.hub.fast_bf16`)."""
    from ..hub import fast_bf16

    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=fast_bf16(device))


def check_fresh_out(out: Path, args: Any) -> None:
    """Refuse (one ValueError line) to train into ``out`` when it holds a trained model
    (``*.safetensors``) and no checkpoint to resume, unless ``args.overwrite``: the shipped models
    under ``models/`` are the recipes' default ``--out``, and a fresh start would replace one with
    whatever this run makes."""
    trained = sorted(p.name for p in out.glob("*.safetensors")) if out.is_dir() else []
    if trained and not (out / STATE_FILE).exists() and not getattr(args, "overwrite", False):
        raise ValueError(f"{out} holds a trained model ({', '.join(trained[:3])}) and no checkpoint to resume; choose "
                         "another --out, or pass --overwrite to train anew there (replacing it)")


class TrainingRun:
    """Args:
        out: the recipe's output directory (created). One that holds a trained model
            (``*.safetensors``) but no checkpoint is refused unless ``args.overwrite``.
        args: the parsed command-line arguments (their scalar values go to training.json).
        time_limit: minutes of this invocation after which :attr:`out_of_time` turns true.
        announce: print the resume line (False on the processes of a sharded run but the first).
    """

    #: settings a resumed run may change without a word: how long and where it runs, not what it trains
    RUN_SETTINGS = ("time_limit", "threads", "resume", "overwrite", "save_every", "device")

    def __init__(self, out: str | Path, args: Any, time_limit: float | None = None, announce: bool = True) -> None:
        self.out = Path(out)
        self.announce = announce
        check_fresh_out(self.out, args)
        self.out.mkdir(parents=True, exist_ok=True)
        from ..cli.output import hold_lock

        rank = os.environ.get("RANK", "0")  # (each process of a launch its own lock: two launches meet rank by rank)
        hold_lock(self.out / f".lock-{rank}", f"{self.out} (a training run)")  # (held until the process ends)
        self.args, self.time_limit = args, time_limit
        self.state_path = self.out / STATE_FILE
        self.step, self.log, self.elapsed = 0, [], 0.0
        self.started = time.time()
        self._checked: dict[str, Any] | None = None  # the checkpoint check_saved read, for resume

    def resume(self) -> dict[str, Any] | None:
        """Load the last checkpoint (-> the recipe's own saved entries) or None on a fresh start."""
        if not self.state_path.exists():
            return None
        state, self._checked = self._checked, None
        if state is None:
            state = torch.load(self.state_path, weights_only=True, map_location="cpu")  # load_state_dict places it
        self.step, self.log, self.elapsed = state.pop("step"), state.pop("log"), state.pop("elapsed")
        self.started = time.time()
        if self.announce:
            changed = self.changed_settings()
            steps = getattr(self.args, "steps", None)
            done = isinstance(steps, int) and not isinstance(steps, bool) and self.step >= steps
            print(f"resuming at step {self.step}" + (f"; changed since the checkpoint: {changed}" if changed else "")
                  + (f" (--steps {steps}: the checkpoint has trained that many, so no step trains; give --steps above {self.step} "
                     "to train on)" if done else " (the rest of the run follows the new values)" if changed else ""),
                  flush=True)
        return state

    def settings(self) -> dict[str, Any]:
        """The arguments' plain values (numbers, strings, flags and lists of them): training.json's ``args``."""
        plain = (int, float, str, bool, type(None))
        return {k: v for k, v in vars(self.args).items()
                if isinstance(v, plain) or (isinstance(v, list) and all(isinstance(x, plain) for x in v))}

    def changed_settings(self) -> str:
        """The settings that shape training (not :data:`RUN_SETTINGS`) whose value differs from the
        last save's training.json, as "lr 0.003 there, 0.001 now; ...": a resume may change them
        (the recipes resume with a longer schedule or another loss weight), and says so."""
        try:
            before = json.loads((self.out / "training.json").read_text())["args"]
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        now = self.settings()
        changed = [k for k in now if k in before and k not in self.RUN_SETTINGS and before[k] != now[k]]
        return "; ".join(f"{k} {before[k]!r} there, {now[k]!r} now" for k in changed)

    def resume_into(self, **stateful: Any) -> dict[str, Any] | None:
        """:meth:`resume`, loading each keyword's saved state dict into it (a module or optimizer
        saved under that name) -> the checkpoint's other entries, or None on a fresh start."""
        state = self.resume()
        if state is None:
            return None
        for name, target in stateful.items():
            with self.restoring():
                target.load_state_dict(state.pop(name))
        return state

    def check_saved(self, *names: str) -> None:
        """Before a recipe's costly preparation (data it writes, a target it loads): a checkpoint in
        ``out`` that lacks one of the entries ``names`` (another recipe's) is :meth:`restoring`'s line.
        The checkpoint read is kept for :meth:`resume`, which then does not read it again."""
        if not self.state_path.exists():
            return
        saved = torch.load(self.state_path, weights_only=True, map_location="cpu")
        with self.restoring():
            missing = [name for name in names if name not in saved]
            if missing:
                raise KeyError(missing[0])
        self._checked = saved

    @contextlib.contextmanager
    def restoring(self):
        """Around loading a checkpoint's entries: one of another recipe, or of other sizes (a
        missing entry, shapes or groups that differ) is one ValueError line naming the folder."""
        try:
            yield
        except (KeyError, RuntimeError, ValueError) as error:
            why = f"no {error.args[0]!r} saved" if isinstance(error, KeyError) else " ".join(str(error).split())
            raise ValueError(f"{self.state_path} is a checkpoint of another run ({why[:200]}); resume it with the "
                             "settings it was started with, or choose another --out") from None

    def optimizer_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, parameters, max_norm: float = 1.0) -> None:
        """One update: zero the gradients, backpropagate ``loss``, clip the gradient norm of
        ``parameters`` to ``max_norm``, step the optimizer; then count the step."""
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        optimizer.step()
        self.step += 1

    @property
    def minutes(self) -> float:
        """Training minutes over all invocations."""
        return (self.elapsed + time.time() - self.started) / 60

    @property
    def out_of_time(self) -> bool:
        return self.time_limit is not None and (time.time() - self.started) / 60 > self.time_limit

    def record(self, **values: Any) -> dict[str, Any]:
        """Append a log entry (with the step and minutes) and print it as one JSON line."""
        entry = {"step": self.step, **{k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in values.items()},
                 "minutes": round(self.minutes, 2)}
        self.log.append(entry)
        print(json.dumps(entry), flush=True)
        return entry

    def save(self, **state: Any) -> None:
        """Write the checkpoint (the recipe's tensors/state dicts + the bookkeeping) and training.json."""
        elapsed = self.elapsed + time.time() - self.started
        tmp = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}.tmp")
        torch.save({**state, "step": self.step, "log": self.log, "elapsed": elapsed}, tmp)
        tmp.replace(self.state_path)
        summary = {"args": self.settings(), "step": self.step, "minutes": round(elapsed / 60, 1), "log": self.log}
        (self.out / "training.json").write_text(json.dumps(summary, indent=1))

    def record_eval(self, metrics: dict[str, float], **about: Any) -> None:
        """Log a validation's ``metrics`` (as ``val_<name>``) and write them to ``OUT/eval.json``
        (for the model card): ``{"step": ..., **about, **metrics}``, ``about`` saying what was measured."""
        self.record(**{f"val_{k}": v for k, v in metrics.items()})
        (self.out / "eval.json").write_text(json.dumps({"step": self.step, **about, **metrics}, indent=1))

    def save_model(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Write ``model`` as it ships (its own ``save`` into :attr:`out`), then the checkpoint with
        its and ``optimizer``'s state dicts (the entries ``resume_into(model=..., optimizer=...)`` loads)."""
        model.save(self.out)
        self.save(model=model.state_dict(), optimizer=optimizer.state_dict())

    def should_save(self, every: int, total_steps: int) -> bool:
        return self.step % every == 0 or self.step >= total_steps or self.out_of_time

    def stop_if_out_of_time(self) -> bool:
        if self.out_of_time:
            print("time limit reached; rerun the same command to resume", flush=True)
        return self.out_of_time


def add_run_arguments(parser: argparse.ArgumentParser, threads: int, save_every: int = 100) -> None:
    """The arguments a recipe passes to its :class:`TrainingRun`: --save-every, --threads, --time-limit,
    and --device (:func:`train_device`)."""
    parser.add_argument("--save-every", type=int, default=save_every)
    parser.add_argument("--threads", type=int, default=threads)
    add_device_argument(parser)
    parser.add_argument("--time-limit", type=float, default=None, help="stop (after a checkpoint) after this many minutes")


def warmup_cosine(step: int, total: int, peak: float, warmup: int, floor: float = 0.0) -> float:
    """Learning rate at ``step``: linear warm-up over ``warmup`` steps times a cosine from 1 to
    ``floor`` over ``total`` steps: peak * min(1, (step + 1) / warmup) * (floor + (1 - floor) * (1 + cos(pi step / total)) / 2)."""
    return peak * min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * step / total)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of ``optimizer`` to ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def draw_rows(lengths: list[int], batch_size: int, generator: torch.Generator, similar: bool = False) -> list[int]:
    """The rows of one training batch: ``batch_size`` uniform draws, or with ``similar`` a run of
    ``batch_size`` neighbours in length order (its start drawn uniformly), so that a batch of
    utterances from 1 to 15 s is not padded to its longest row: the padding, and with it most of
    a step's cost, shrinks, at the price of batches less mixed in length."""
    if not similar or len(lengths) <= batch_size:
        return torch.randint(len(lengths), (batch_size,), generator=generator).tolist()
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    start = int(torch.randint(len(lengths) - batch_size + 1, (1,), generator=generator))
    return order[start:start + batch_size]
