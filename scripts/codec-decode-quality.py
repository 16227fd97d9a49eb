"""The embedded voice's codec decoded with several Griffin-Lim settings, side by side (docs/speech.md,
"The codec's decode"): Piper's audio through the codec and the voice's own codes (plain decoding at
its default settings, seed = the sentence's index), each decoded with every setting.

    python scripts/codec-decode-quality.py [SENTENCES] [START:ITERATIONS,...] [OUT.json]

(defaults: 200 hand-written held-out sentences; random:32,pghi:16,pghi:12,random:16; no file).
Prints and writes, per source and setting: Whisper tiny.en's WER, speaker similarity to Piper's
audio of the sentence, spectral convergence || |STFT(x)| - S || / || S || against the magnitude
S the codec asked for (mean over sentences), and the decode's real-time factor (one thread).
"""

import dataclasses
import json
import sys
import time

import torch

import mmspec
from mmspec.modeling.mel_codec import with_decoding
from mmspec.bench.results import machine_info
from mmspec.bench.tts import TEXTS
from mmspec.metrics.speech import speaker_embedding, transcribe, word_error_rate
from mmspec.train.speech_data import load_voice, synthesise


def spectral_convergence(codec, codes: torch.Tensor, audio: torch.Tensor) -> float:
    c = codec.config
    magnitude = codec.magnitude(codec.dequantise(codes))
    got = torch.stft(audio, c.n_fft, c.hop_length, window=torch.hann_window(c.n_fft), return_complex=True).abs()
    frames = min(got.shape[1], magnitude.shape[1])
    return float((got[:, :frames] - magnitude[:, :frames]).norm() / magnitude[:, :frames].norm())


def main(sentences: int = 200, settings: str = "random:32,pghi:16,pghi:12,random:16", out: str | None = None) -> None:
    torch.set_num_threads(1)
    texts = [text for _, text in TEXTS["handwritten"](sentences)]
    pipe = mmspec.pipeline("text-to-speech")
    machine = machine_info(str(pipe.components.dtype).removeprefix("torch."), 1)  # (the commit measured, read now)
    codec, rate = pipe.components.codec, pipe.sampling_rate
    voice = load_voice()
    source = [audio.float() / 32768 for _, audio, _ in (synthesise(voice, text, noise=False) for text in texts)]
    references = [speaker_embedding(audio, voice.config.sample_rate) for audio in source]
    codes = {"piper through the codec": [codec.encode(audio, voice.config.sample_rate) for audio in source],
             "the voice's codes": [pipe(text, seed=i, method="ar").codes for i, text in enumerate(texts)]}
    shipped, rows = codec.config, []
    for setting in settings.split(","):
        codec.config = with_decoding(shipped, setting)
        start, iterations = codec.config.griffin_lim_start, codec.config.griffin_lim_iters
        for name, source_codes in codes.items():
            begun = time.perf_counter()
            audio = [codec.decode(c) for c in source_codes]
            spent = time.perf_counter() - begun
            seconds = sum(a.shape[0] for a in audio) / rate
            row = {"source": name, "start": start, "iterations": int(iterations),
                   "wer": word_error_rate(texts, [transcribe(a, rate) for a in audio]),
                   "similarity": sum(float(speaker_embedding(a, rate) @ r) for a, r in zip(audio, references)) / len(texts),
                   "spectral_convergence": sum(spectral_convergence(codec, c, a)
                                               for c, a in zip(source_codes, audio)) / len(texts),
                   "decode_rtf": spent / seconds, "seconds": seconds}
            rows.append(row)
            print(json.dumps(row), flush=True)
    codec.config = shipped
    if out:
        with open(out, "w") as f:
            json.dump({"sentences": sentences, "machine": machine,
                       "shipped": dataclasses.asdict(shipped), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:])))
