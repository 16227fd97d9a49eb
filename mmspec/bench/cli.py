"""``mmspec bench SUITE``."""

from __future__ import annotations

from ..cli import command_help

#: output files of the text and caption suites, checked before the model loads (cli.args.check_args)
OUTPUT_ARGS = {"results": "file", "markdown": "file"}


def interrupted(args, command: str) -> str:
    """What Ctrl-C leaves of a benchmark (the line mmspec prints): its results file, written after
    every measurement, and how to resume."""
    return f"the measurements finished so far are saved in {args.results}; rerun the same command to resume: {command}"


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help=command_help("bench"))
    suites = bench.add_subparsers(dest="suite", metavar="SUITE")
    from . import caption, chain_stop, cost, t2i, text, tts, vllm

    text_parser = suites.add_parser("text", help="a causal LM (SmolLM2): AR vs training-free drafters vs transformers' options")
    text.add_arguments(text_parser)
    text_parser.set_defaults(handler=text.run, output_args=OUTPUT_ARGS, interrupted=interrupted)
    caption_parser = suites.add_parser("caption", help="a captioning VLM (default: the embedded captioner): AR vs drafters per task family")
    caption.add_arguments(caption_parser)
    caption_parser.set_defaults(handler=caption.run, output_args=OUTPUT_ARGS, interrupted=interrupted)
    stop_parser = suites.add_parser("chain-stop", help="an EAGLE / EAGLE-3 chain's K and confidence stop on this machine (--write saves the fastest)")
    chain_stop.add_arguments(stop_parser)
    stop_parser.set_defaults(handler=chain_stop.run, output_args=OUTPUT_ARGS, interrupted=interrupted)
    t2i_parser = suites.add_parser("t2i", help="text-to-image: AR vs spec, SJD (each init), coupled SJD on the embedded model")
    t2i.add_arguments(t2i_parser)
    t2i_parser.set_defaults(handler=t2i.run, output_args={**OUTPUT_ARGS, "plot": "file"}, interrupted=interrupted)
    cost_parser = suites.add_parser("cost", help="the verification cost curve C(n)/C(1), by part, as loaded and optimized")
    cost.add_arguments(cost_parser)
    cost_parser.set_defaults(handler=cost.run, output_args=OUTPUT_ARGS)
    tts_parser = suites.add_parser("tts", help="text-to-speech: every method on held-out sentences, speed and WER")
    tts.add_arguments(tts_parser)
    tts_parser.set_defaults(handler=tts.run, output_args=OUTPUT_ARGS, interrupted=interrupted)
    vllm_parser = suites.add_parser("vllm", help="an EAGLE-3 head served by vLLM (another environment) beside mmspec: acceptance, outputs, speed")
    vllm.add_arguments(vllm_parser)
    vllm_parser.set_defaults(handler=vllm.run, output_args={**OUTPUT_ARGS, "work": "dir"})
