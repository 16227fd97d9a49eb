"""``mmspec generate``: text generation from the command line on a causal LM such as SmolLM2."""

from __future__ import annotations

import json

import torch

from . import command_help
from ..api import chat_inputs, check_text_prompt, generate, generate_with_baseline, optimize_components
from ..drafters import check_draft_length_use
from ..drafters.model import check_draft_vocabulary, config_vocab_size
from ..hub import load_causal_lm, resolve_checkpoint, resolve_device
from ..pipelines.captioning.methods import check_drafter_name
from .output import difference_note, speedup_words
from ..core import words


def add_parser(subparsers) -> None:
    from .args import add_model_args, add_sampling_args, add_trust_remote_code_arg

    gen = subparsers.add_parser("generate", help=command_help("generate"))
    gen.add_argument("prompt", help="the user message (wrapped in the model's chat template unless --raw)")
    gen.add_argument("--drafter", default="prompt-lookup",
                     help="ar | prompt-lookup[:K] | layer-skip:N | sjd | sjd-coupled | a draft model path | a trained head: "
                          "eagle:DIR, eagle2:DIR, eagle3:DIR, eagle3-tree:DIR, medusa:DIR, hydra:DIR, kangaroo:DIR "
                          "(mmspec train drafter), assistant:DIR (Gemma 4)")
    gen.add_argument("--num-draft-tokens", type=int, default=None, help="K (default: the drafter's own)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as plain text, no chat template")
    gen.add_argument("--compare-baseline", action="store_true", help="also run plain AR decoding and report the speedup")
    gen.add_argument("--json", action="store_true", help="machine-readable output")
    add_model_args(gen, default_model="smollm2")
    add_trust_remote_code_arg(gen, "the model's (and a draft model's)")
    add_sampling_args(gen, seed=None)
    gen.set_defaults(handler=run_generate_command)


def run_generate_command(args) -> int:
    check_text_prompt(args.prompt)  # this and the drafter before anything loads
    drafter = args.drafter
    check_draft_length_use(drafter, args.num_draft_tokens)
    draft_dir = check_drafter_name(drafter, auto=False)  # a spec's settings checked (the one spec syntax); else a directory
    device = resolve_device(args.device)
    if draft_dir is not None:  # a draft of another tokenizer: from the two configs, before either model loads
        check_draft_vocabulary(config_vocab_size(draft_dir), config_vocab_size(resolve_checkpoint(args.model)))
    model, tokenizer = load_causal_lm(args.model, dtype=args.dtype, device=device, trust_remote_code=args.trust_remote_code)
    if not args.raw and getattr(tokenizer, "chat_template", None) is None:  # (the prompt went in as plain text, unsaid)
        raise ValueError(f"the tokenizer of {args.model} has no chat template to wrap the prompt in; pass --raw to feed it "
                         "as plain text (a base model), or add the model's template to its directory (chat_template.jinja)")
    inputs = {k: v.to(device) for k, v in chat_inputs(tokenizer, args.prompt, raw=args.raw).items()}
    if draft_dir is not None:
        drafter, _ = load_causal_lm(draft_dir, dtype=model.dtype, device=device, tokenizer=False,
                                    trust_remote_code=args.trust_remote_code)
    linears = optimize_components(model, drafter if draft_dir is not None else None).label if args.optimize else "as loaded"
    kwargs = dict(
        max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, num_draft_tokens=args.num_draft_tokens,
    )
    baseline = None
    if args.compare_baseline:
        out, baseline = generate_with_baseline(model, drafter, inputs, **kwargs)
    else:
        out = generate(model, drafter=drafter, **kwargs, **inputs)
    prompt_len = inputs["input_ids"].shape[1]
    text = tokenizer.decode(out.sequences[0, prompt_len:], skip_special_tokens=True)
    out.stats.config["linears"] = linears
    result = {"text": text, "stats": out.stats.to_dict()}
    if baseline is not None:
        result["baseline_text"] = tokenizer.decode(baseline.sequences[0, prompt_len:], skip_special_tokens=True)
        result["baseline_stats"] = baseline.stats.to_dict()
        result["identical_to_baseline"] = bool(torch.equal(out.sequences, baseline.sequences))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(text)
    print()
    print(out.stats.summary())
    if baseline is not None:
        print(baseline.stats.summary() + "  [baseline, same run]")
        same = "identical to" if result["identical_to_baseline"] else "DIFFERENT from"
        threads = torch.get_num_threads()
        print(f"output {same} plain decoding; {speedup_words(out.stats, baseline.stats)} "
              f"({str(model.dtype).removeprefix('torch.')}, {words.count(threads, 'thread')})")
        note = difference_note(args.do_sample, model.dtype in (torch.bfloat16, torch.float16))
        if not result["identical_to_baseline"] and note:
            print(note)
    return 0
