"""The embedded text-to-image model's scene renders (:mod:`mmspec.train.t2i_data`): a pool of forked
workers only from a process without other Python threads (a fork copies a lock another thread
holds, and the child can wait on it for ever: a CI test worker hung so in stop 83); there the
images are rendered in the calling process, the same as one worker's. (No pool is started here: a
pytest-xdist worker's I/O thread is not one that ``threading`` counts.)"""

import threading

import torch

from mmspec.train import t2i_data


def test_no_fork_beside_other_threads_and_the_same_images(tmp_path, monkeypatch):
    monkeypatch.setattr(t2i_data, "POOL_FROM", 8)
    monkeypatch.setattr(t2i_data, "cache_root", lambda: tmp_path / "a")
    alone, captions = t2i_data.scene_pool("validation", 12, size=32, workers=1)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        def no_fork(*args):
            raise AssertionError("forked beside another thread")
        with monkeypatch.context() as m:
            m.setattr(t2i_data, "get_context", no_fork)
            m.setattr(t2i_data, "cache_root", lambda: tmp_path / "b")
            beside, beside_captions = t2i_data.scene_pool("validation", 12, size=32, workers=2)
    finally:
        stop.set()
        other.join()
    assert torch.equal(beside, alone) and beside_captions == captions
