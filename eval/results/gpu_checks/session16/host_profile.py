"""Session 16: where the host time of a B=1, S=32k generate() decode step goes (random-init Llama-3.1-8B shapes,
8 layers, fp16). Per cache: ms/token as eval.speed measures it (StepClock, median), then cProfile over the decode
steps only (enabled by the logits processor after the prefill), top functions by own and cumulative time.
    python eval/results/gpu_checks/session16/host_profile.py [caches] [new_tokens] [noprof]"""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
from transformers import LogitsProcessorList

from eval import common
from eval.speed import StepClock

caches = (sys.argv[1] if len(sys.argv) > 1 else "fp16,4bit-all,4bit").split(",")
new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 48
model = common.random_llama("random:llama-3.1-8b,layers=8", torch.float16, "cuda", "sdpa")
prompt = torch.randint(0, model.config.vocab_size, (1, 32768), device="cuda")


class Profiled(StepClock):
    def __init__(self, prof):
        super().__init__("cuda")
        self.prof = prof

    def __call__(self, input_ids, scores):
        out = super().__call__(input_ids, scores)
        if len(self.stamps) == 3:  # two decode steps done: warm
            self.prof.enable()
        return out


for name in caches:
    spec = common.cache_spec(name)
    common.set_attention(model, spec.attn_implementation)
    for profiled in (False, False) + ((True,) if "noprof" not in sys.argv else ()):
        prof = cProfile.Profile()
        clock = Profiled(prof) if profiled else StepClock("cuda")
        with torch.inference_mode():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False,
                           logits_processor=LogitsProcessorList([clock]), pad_token_id=0, eos_token_id=None,
                           **common.with_cache(model, spec.build(model.config)))
        prof.disable()
        gaps = [1e3 * (b - a) for a, b in zip(clock.stamps, clock.stamps[1:])]
        print(f"{name} {'profiled' if profiled else 'timed'}: decode ms/token median {statistics.median(gaps):.3f}")
    if "noprof" in sys.argv:
        continue
    steps = new_tokens - 3
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(45)
    print(f"== {name}: cProfile over {steps} decode steps (8 layers each)")
    print(s.getvalue())
