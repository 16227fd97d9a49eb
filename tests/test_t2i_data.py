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


def _grids_twice(tmp_path, monkeypatch, module, cached, weights_name):
    """Run a recipe's cached encode over two tokenizer files of the same size and the same time
    stamp (replaced within one second, or copied with ``cp -p``): the second must not reuse the
    first's cache."""
    import os

    monkeypatch.setattr(module, "cache_root", lambda: tmp_path / "cache")
    (tmp_path / "cache").mkdir(parents=True)
    monkeypatch.setattr(module, "scene_pool", lambda split, n, size: (torch.zeros(n, 3, size, size, dtype=torch.uint8), None))
    weights = tmp_path / "tok" / weights_name
    weights.parent.mkdir(parents=True)
    results = []
    for value in (1.0, 2.0):
        weights.write_bytes(bytes([int(value)]) * 64)
        os.utime(weights, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))

        class Tokenizer:
            def encode(self, images):
                return torch.full((len(images), 1, 2, 2), value)

        results.append(cached(Tokenizer(), weights.parent, "train", 3, 8))
    return results


def test_recipe_caches_are_keyed_by_the_tokenizer_content(tmp_path, monkeypatch):
    from mmspec.train import mar, t2i

    first, second = _grids_twice(tmp_path / "t2i", monkeypatch, t2i, t2i.token_grids, "vq.safetensors")
    assert not torch.equal(first, second)
    first, second = _grids_twice(tmp_path / "mar", monkeypatch, mar, mar.latent_tokens, "kl.safetensors")
    assert not torch.equal(first, second)


def test_content_stamp_is_the_files_sha256(tmp_path):
    """A cache key changes with the file's bytes, not its time stamp."""
    import hashlib

    from mmspec.train.t2i_data import content_stamp

    path = tmp_path / "weights.bin"
    path.write_bytes(b"x" * 3_000_000)
    assert content_stamp(path) == hashlib.sha256(b"x" * 3_000_000).hexdigest()[:16]
    path.write_bytes(b"y" * 3_000_000)
    assert content_stamp(path) == hashlib.sha256(b"y" * 3_000_000).hexdigest()[:16]
