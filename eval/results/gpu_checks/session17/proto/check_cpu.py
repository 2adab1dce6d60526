"""CPU (TRITON_INTERPRET=1): the prototype's gather path against reference.paged_attention on a small pool."""
import os, sys
sys.path.insert(0, "."); sys.path.insert(0, ".scratch/ws")
import torch
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import BlockLayout
from tq_hf import reference
from tq_hf.kernels.key_lut import config_lut_bytes, lut_words_asm
import wsdecode

torch.manual_seed(0)
dev = os.environ.get("DEV", "cpu")
hk, hq, d, t = 4, 16, 128, 16
cfg = TurboQuantConfig.from_preset("4bit", block_size=t, key_centering=False, value_rotation=False, exact_prefix_tokens=0, recent_window=0)
lay = BlockLayout(cfg, hk, d)
lens = [300, 77]
nbr = 20
b = len(lens)
pool = lay.allocate(b * nbr, dev)
table = torch.randperm(b * nbr, device=dev).view(b, nbr).to(torch.int32)
for r, n in enumerate(lens):
    pos = torch.arange(n, device=dev)
    slots = table[r].long()[pos // t] * t + pos % t
    k = torch.randn(n, hk, d, device=dev) * 3
    v = torch.randn(n, hk, d, device=dev)
    reference.store(pool, lay, k, v, slots)
seq = torch.tensor(lens, device=dev)
q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.float16)
scale = d ** -0.5
ref = reference.paged_attention(q, pool, lay, table, seq, scale).float()
codec = reference.key_codec(cfg, d, dev)
(l0, l1), unit = config_lut_bytes(cfg, d)
tab = (codec.code_centroids / unit).half()  # the asm's values: centroid / KEY_UNIT
ns = 2
ptx = dev != "cpu"
pout, plse = wsdecode.launch(q, codec.rotation, scale, unit, pool, lay, table, seq, ns, lut_words_asm((l0, l1)), tab, ptx=ptx,
                             tpw=int(os.environ.get("TPW", 16)), w=int(os.environ.get("W", 4)), qpre=bool(int(os.environ.get("QPRE", 0))))
# merge the splits (reduce kernel's math)
pl = plse.view(b, hk, ns, 8)[..., :4]
po = pout.view(b, hk, ns, 8, d)[..., :4, :]
w = torch.exp2(pl - pl.amax(2, keepdim=True))
out = (po * w[..., None]).sum(2) / w.sum(2)[..., None]  # [b, hk, 4, d]
out = out.reshape(b, hq, 1, d)
err = (out - ref).abs().max().item() / ref.abs().max().item()
print("rel err", err, "ok" if err < 2e-3 else "MISMATCH")

if int(os.environ.get("FUSE", 0)):
    out2 = torch.full_like(q, float("nan"))
    cnt = torch.zeros(b * hk // 2, dtype=torch.int32, device=dev)
    for rep in range(2):
        out2.fill_(float("nan"))
        wsdecode.launch(q, codec.rotation, scale, unit, pool, lay, table, seq, ns, lut_words_asm((l0, l1)), tab, ptx=ptx,
                        tpw=int(os.environ.get("TPW", 16)), w=int(os.environ.get("W", 4)), out=out2, cnt=cnt)
        err2 = (out2.float() - ref).abs().max().item() / ref.abs().max().item()
        print("fused rel err", err2, "counters", cnt.tolist(), "ok" if err2 < 2e-3 and not cnt.any() else "MISMATCH")
