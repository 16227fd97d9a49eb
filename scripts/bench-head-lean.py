"""`python scripts/bench-head-lean.py [OUT.json]`: time one EAGLE head call (SmolLM2-135M's layer shape: width 576, 9 heads / 3 KV heads, MLP 1536)
lean vs transformers' forward, after mmspec.optimize, fp32 and bf16, 1 thread."""
import time, torch, json, sys
torch.set_num_threads(1)
from transformers import LlamaConfig
import mmspec
from mmspec.modeling.heads import EagleHead
from mmspec.core.cache import make_cache, crop_cache
cfg = LlamaConfig(vocab_size=1, hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=2048, attn_implementation="sdpa", pad_token_id=None, bos_token_id=None, eos_token_id=None)
rows = []
for dtype in (torch.float32, torch.bfloat16):
    torch.manual_seed(0)
    head = EagleHead(cfg).eval().to(dtype)
    mmspec.optimize(head)
    x = torch.randn(1, 300, 576, dtype=dtype)
    for lean in (False, True):
        head.lean = lean
        for n in (1, 8):
            cache = make_cache(head.config)
            with torch.no_grad():
                head(x[:, :280], x[:, :280], cache, torch.arange(280)[None])
                f = lambda: head(x[:, 280:280 + n], x[:, 280:280 + n], cache, torch.arange(280, 280 + n)[None])
                for _ in range(20): f(); crop_cache(cache, 280)
                t = time.perf_counter()
                for _ in range(300): f(); crop_cache(cache, 280)
            rows.append({"dtype": str(dtype).split(".")[-1], "forward": "lean" if lean else "transformers", "rows": n, "ms": round((time.perf_counter() - t) / 300 * 1e3, 3)})
            print(rows[-1], flush=True)
from mmspec.bench.results import machine_info
out = sys.argv[1] if len(sys.argv) > 1 else None
if out:
    with open(out, "w") as f:
        json.dump({"machine": machine_info("float32 and bfloat16", 1), "command": "taskset -c 1 python scripts/bench-head-lean.py " + out, "rows": rows}, f, indent=1)
