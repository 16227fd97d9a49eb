"""The shared resumable-training bookkeeping of ``mmspec train``."""

import argparse
import json

import torch

from mmspec.train.checkpoint import TrainingRun


def test_training_run_resumes_step_log_time_and_recipe_state(tmp_path):
    args = argparse.Namespace(steps=10, lr=0.1, name="x", things=[1, 2], handler=print)
    run = TrainingRun(tmp_path / "out", args)
    assert run.resume() is None
    weights = torch.arange(3.0)
    for _ in range(4):
        run.step += 1
    run.record(loss=1.234567)
    run.save(weights=weights)
    card = json.loads((tmp_path / "out" / "training.json").read_text())
    assert card["step"] == 4 and card["args"] == {"steps": 10, "lr": 0.1, "name": "x", "things": [1, 2]}
    assert card["log"][0]["loss"] == 1.235

    again = TrainingRun(tmp_path / "out", args)
    state = again.resume()
    assert again.step == 4 and again.log == card["log"]
    assert torch.equal(state["weights"], weights) and set(state) == {"weights"}
    assert again.should_save(100, total_steps=4) and not again.should_save(100, total_steps=10)


def test_a_resume_names_the_settings_that_changed(tmp_path, capsys):
    """The stop-78 audit: a resume with another --lr or --batch-size said only "resuming at step
    40" (the recipes resume with a longer schedule or another loss weight, so it is not refused)."""
    args = argparse.Namespace(steps=10, lr=0.003, batch_size=4, threads=1, time_limit=5.0)
    run = TrainingRun(tmp_path, args)
    run.step = 4
    run.save(weights=torch.zeros(1))
    TrainingRun(tmp_path, argparse.Namespace(**{**vars(args), "threads": 2, "time_limit": 9.0})).resume()
    assert capsys.readouterr().out == "resuming at step 4\n"  # (threads and time limit: how it runs, not what)
    TrainingRun(tmp_path, argparse.Namespace(**{**vars(args), "lr": 0.001, "steps": 20})).resume()
    assert capsys.readouterr().out == ("resuming at step 4; changed since the checkpoint: steps 10 there, 20 now; lr 0.003 "
                                       "there, 0.001 now (the rest of the run follows the new values)\n")
    # --steps at or below the checkpoint's step: no step trains, and the line says so (it said "the rest of the
    # run follows the new values", the drafter audit after stop 86)
    TrainingRun(tmp_path, argparse.Namespace(**{**vars(args), "steps": 3})).resume()
    assert capsys.readouterr().out == ("resuming at step 4; changed since the checkpoint: steps 10 there, 3 now (--steps 3: "
                                       "the checkpoint has trained that many, so no step trains; give --steps above 4 to train on)\n")
    TrainingRun(tmp_path, args, announce=False).resume()  # (the other processes of a sharded run)
    assert capsys.readouterr().out == ""


def test_training_run_time_limit(tmp_path):
    run = TrainingRun(tmp_path, argparse.Namespace(), time_limit=0.0)
    run.started -= 1.0
    assert run.out_of_time and run.stop_if_out_of_time() and run.should_save(100, 10)
    assert not TrainingRun(tmp_path, argparse.Namespace(), time_limit=None).out_of_time


def test_resume_into_loads_named_state_dicts(tmp_path):
    args = argparse.Namespace(steps=4)
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert TrainingRun(tmp_path, args).resume_into(model=layer, optimizer=optimizer) is None
    run = TrainingRun(tmp_path, args)
    run.step = 3
    run.save(model=layer.state_dict(), optimizer=optimizer.state_dict(), extra=torch.ones(1))
    fresh = torch.nn.Linear(2, 2)
    rest = TrainingRun(tmp_path, args).resume_into(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert set(rest) == {"extra"} and torch.equal(fresh.weight, layer.weight)


def test_similar_length_batches_are_neighbours_in_length_order():
    import torch

    from mmspec.train.checkpoint import draw_rows

    lengths = [50, 3, 41, 8, 27, 15, 33, 21, 1, 12]
    generator = torch.Generator().manual_seed(0)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    starts = set()
    for _ in range(200):
        rows = draw_rows(lengths, 4, generator, similar=True)
        start = order.index(rows[0])
        assert rows == order[start:start + 4]
        starts.add(start)
    assert starts == set(range(len(lengths) - 3))  # every window is drawn
    uniform = draw_rows(lengths, 4, torch.Generator().manual_seed(0))
    assert uniform == torch.randint(len(lengths), (4,), generator=torch.Generator().manual_seed(0)).tolist()


def test_train_drafter_takes_the_issues_kind_spelling():
    """``mmspec train drafter --kind eagle3|eagle2|...`` (the spelling of ``tts-drafter`` and the docs)
    is ``--method``; eagle2 trains the EAGLE head, which EAGLE-2 drafts its trees with."""
    from mmspec.train.drafter import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--kind", "eagle3"]).method == "eagle3"
    assert parser.parse_args(["--kind", "eagle2"]).method == "eagle"
    assert parser.parse_args(["--method", "hydra"]).method == "hydra"
    assert parser.parse_args([]).method == "eagle"


def test_a_self_distillation_cache_of_other_settings_is_refused(tmp_path):
    """The stop-78 audit: the smollm2 recipes (eagle's template prompts, hydra's task prompts) share
    the default runs/smollm2-selfdistill, and the second silently trained on the first's data."""
    import pytest

    from mmspec.train.drafter import DATA_SETTINGS, check_data_settings

    args = argparse.Namespace(target="smollm2", prompt_set="tasks", skip=0, max_new_tokens=128)
    check_data_settings(args, tmp_path)  # (no manifest: a new folder, or one made before manifests)
    (tmp_path / "data.json").write_text(json.dumps({name: getattr(args, name, None) for name in DATA_SETTINGS}))
    check_data_settings(args, tmp_path)
    with pytest.raises(ValueError, match=r"holds self-distilled data made with other settings \(prompt_set 'tasks' there, "
                                         r"'templates' now\); give another --data folder"):
        check_data_settings(argparse.Namespace(**{**vars(args), "prompt_set": "templates"}), tmp_path)
