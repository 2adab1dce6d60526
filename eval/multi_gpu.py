"""TurboQuantCache on several devices: accelerate's device_map and transformers' tensor parallelism.

Two modes, each comparing against the same checkpoint generating on ONE device:

  device_map (default)   python -m eval.multi_gpu
      Loads the checkpoint with device_map="auto" over the GPUs in --devices (max_memory forces a
      split), generates greedily with TurboQuantCache and checks that every layer's compressed pool
      (and its block table, lengths, padding starts) lives on that layer's execution device.
      --devices cpu,disk --device-map even runs the same path on a CPU machine (accelerate offloads
      the "disk" layers and runs them on the CPU through its hooks).

  tensor parallel        torchrun --nproc-per-node 2 -m eval.multi_gpu --tp
      Loads the checkpoint with tp_plan="auto" (NCCL on GPUs, gloo on CPU), generates with
      TurboQuantCache, checks that every rank's compressed layers hold KV heads / world heads and
      that each rank's KV bytes are the single-device bytes / world.

Tokens: the run passes when the greedy tokens equal the single-device tokens, or when the first
difference comes after a near-tie in the single-device logits (top-1 minus the other run's choice
< --tie-tolerance): tensor parallelism sums partial products in another order, which may flip the
argmax of a random-init model's nearly flat logits. The fp16 DynamicCache is run the same way as a
control, so a divergence that the plain cache shows too is not the compressed cache's doing.

The model defaults to a random-init Llama with Llama-3.1-8B shapes and 8 layers (32/8/128, fp16),
saved once as a checkpoint in a temporary folder so that every loader reads the same weights.
Results: a table on stdout, and MODE.json / MODE.md under --out (MODE: device_map or tp). Exit status 1 when
a check fails.

Machines that share GPUs keep NVLink multicast off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set here unless already set.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from eval.common import markdown_table, md_header, parse_random_spec, random_llama, run_metadata, write_json  # noqa: E402

DEFAULT_MODEL = "random:llama-3.1-8b,layers=8"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
LAYER_TENSORS = ("pool", "block_table", "seq_lens", "_row_slots", "kv_start", "key_offset", "prefix_keys",
                 "prefix_values")  # every tensor a TurboQuantLayer keeps: all must sit on its layer's device
PAD_ID = 0
MAX_MEMORY_SHARE = 0.75  # device_map="auto": each GPU may hold this fraction of the weights


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.multi_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", action="store_true", help="tensor-parallel mode (start with torchrun --nproc-per-node N)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="random:<shape>[,layers=N...] or a local checkpoint folder")
    p.add_argument("--dtype", default="float16", choices=list(DTYPES))
    p.add_argument("--preset", default="4bit", help="TurboQuantCache preset")
    p.add_argument("--compress-all", action="store_true",
                   help="compress every layer (default: the preset's full-precision first/last layers stay dense)")
    p.add_argument("--batch", type=int, default=2, help="rows; row r is left padded by r * 7 tokens")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens in the longest prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated")
    p.add_argument("--devices", help="device_map mode: devices to spread layers over "
                   "(default: every visible GPU, e.g. cuda:0,cuda:1; on CPU: cpu,disk)")
    p.add_argument("--device-map", default="auto", choices=["auto", "even"],
                   help="auto: accelerate's device_map='auto' with max_memory forcing a split over the GPUs; "
                   "even: an explicit map giving each device an equal run of decoder layers")
    p.add_argument("--tie-tolerance", type=float, default=0.05,
                   help="a first token difference counts as a near-tie when the single-device logit margin is below this")
    p.add_argument("--workdir", help="where the checkpoint is written (default: a fresh temporary folder, removed)")
    p.add_argument("--out", default="eval/results/multi_gpu", help="output folder")
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompt_len <= 7 * (args.batch - 1):
        raise ValueError(f"--prompt-len {args.prompt_len} is too short for --batch {args.batch} (padding 7 per row)")
    return args


# ---- model, prompts, generation ----------------------------------------------------------------
def build_checkpoint(spec: str, dtype: torch.dtype, device: str | torch.device, folder: Path):
    """(model on `device`, checkpoint folder): a random-init Llama saved to `folder`, or a folder as given.

    The one-device model is loaded back from the checkpoint, exactly as the split models are: the
    model as built holds buffers that loading recomputes (RoPE's inv_freq, cast to fp16 by
    `.to(dtype)` but rebuilt in fp32 by from_pretrained), which changed fp16 logits by ~1e-2 and
    made the one-GPU and two-GPU runs differ for reasons that have nothing to do with the cache.
    """
    import tq_hf  # noqa: F401  (registers "turboquant")

    if spec.startswith("random"):
        parse_random_spec(spec)  # fail early on a bad shape
        random_llama(spec, dtype, str(device), "turboquant").save_pretrained(folder)
        checkpoint = folder
    else:
        checkpoint = Path(spec)
    return load(checkpoint, dtype).to(device), checkpoint


def _for_greedy(model):
    """Fixed-length greedy outputs: no EOS stop, pad id 0."""
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def load(folder: Path, dtype: torch.dtype, **placement):
    """The checkpoint with attn_implementation="turboquant" and a device_map or tp_plan."""
    from transformers import AutoModelForCausalLM

    import tq_hf  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="turboquant", **placement)
    return _for_greedy(model.eval())


def prompt_batch(vocab: int, batch: int, length: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts, row r left padded by 7 * r tokens: (input_ids, attention_mask) [batch, length]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        ids[row, : 7 * row] = PAD_ID
        mask[row, : 7 * row] = 0
    return ids.to(device), mask.to(device)


def cache_kwarg(model, cache) -> dict:
    import inspect

    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def greedy(model, ids: torch.Tensor, mask: torch.Tensor, cache, new_tokens: int) -> dict:
    """Generate greedily: new tokens [B, new] and per-step logits [new, B, V] (both on the CPU), seconds."""
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, return_dict_in_generate=True, output_logits=True,
                         **cache_kwarg(model, cache))
    if ids.is_cuda:
        torch.cuda.synchronize()
    return {"tokens": out.sequences[:, ids.shape[1]:].cpu(), "logits": torch.stack(out.logits).float().cpu(),
            "seconds": time.perf_counter() - start}


def new_cache(kind: str, config, args) -> object:
    """A fresh cache of `kind` ("turboquant" with args.preset / args.compress_all, or "fp16-dynamic")."""
    from transformers import DynamicCache

    from tq_hf import TurboQuantCache, TurboQuantConfig

    if kind != "turboquant":
        return DynamicCache()
    extra = {"full_precision_layers": ()} if args.compress_all else {}
    return TurboQuantCache(config, tq_config=TurboQuantConfig.from_preset(args.preset, **extra))


CACHE_KINDS = ("turboquant", "fp16-dynamic")


# ---- checks ------------------------------------------------------------------------------------
def compare_tokens(reference: dict, run: dict, tie_tolerance: float) -> dict:
    """Equal tokens, or where and why they first differ (near-tie in the reference logits or not)."""
    ref, got = reference["tokens"], run["tokens"]
    if torch.equal(ref, got):
        return {"verdict": "identical", "ok": True}
    diff = (ref != got).int()
    step = int(diff.any(0).int().argmax())
    row = int(diff[:, step].argmax())
    logits = reference["logits"][step, row]
    margin = float(logits[ref[row, step]] - logits[got[row, step]])
    near_tie = margin < tie_tolerance
    return {"verdict": "near-tie" if near_tie else "DIVERGED", "ok": near_tie, "first_diff_step": step,
            "row": row, "reference_margin": margin, "equal_tokens_before": step}


def layer_device(module) -> torch.device:
    """Where a decoder layer runs: accelerate's execution device if hooked, else its weights' device."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    return next(module.parameters()).device


def cache_layer_tensors(layer) -> dict[str, torch.Tensor]:
    """Every tensor a cache layer holds (TurboQuantLayer or DynamicLayer)."""
    names = LAYER_TENSORS if hasattr(layer, "pool") else ("keys", "values")
    return {n: t for n in names if isinstance(t := getattr(layer, n, None), torch.Tensor)}


def placement(model, cache) -> list[dict]:
    """Per layer: its execution device, the devices of the cache layer's tensors, KV bytes, KV heads."""
    rows = []
    for index, (module, layer) in enumerate(zip(model.model.layers, cache.layers)):
        tensors = cache_layer_tensors(layer)
        where = layer_device(module)
        devices = sorted({str(t.device) for t in tensors.values()})
        compressed = hasattr(layer, "pool")
        rows.append({
            "layer": index, "mapped_to": _device_name(getattr(model, "hf_device_map", {}).get(f"model.layers.{index}", where)), "kind": "compressed" if compressed else "full precision", "layer_device": str(where),
            "cache_devices": devices, "ok": bool(tensors) and devices == [str(where)],
            "kv_heads": int(layer.pool.shape[1]) if compressed else int(layer.keys.shape[1]),
            "kv_bytes": sum(t.numel() * t.element_size() for n, t in tensors.items()
                            if n in ("pool", "prefix_keys", "prefix_values", "keys", "values")),
        })
    return rows


def _device_name(value) -> str:
    """hf_device_map values (GPU index, "cpu", "disk", a device) as device strings."""
    return f"cuda:{value}" if isinstance(value, int) else str(value)


def bytes_per_device(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["layer_device"]] = out.get(r["layer_device"], 0) + r["kv_bytes"]
    return out


# ---- device_map mode ---------------------------------------------------------------------------
def default_devices() -> list[str]:
    n = torch.cuda.device_count()
    return [f"cuda:{i}" for i in range(n)] if n else ["cpu", "disk"]


def even_device_map(num_layers: int, devices: list[str]) -> dict[str, str]:
    """Decoder layers in equal consecutive runs over `devices`; embeddings on the first, head on the last.

    A "disk" entry is offloaded by accelerate and run on the first non-disk device.
    """
    if not devices:
        raise ValueError("--devices must name at least one device")
    compute = [d for d in devices if d != "disk"]
    if not compute:
        raise ValueError(f"--devices {','.join(devices)} names no device to compute on (disk only)")
    per = -(-num_layers // len(devices))
    dm = {f"model.layers.{i}": devices[i // per] for i in range(num_layers)}
    dm.update({"model.embed_tokens": compute[0], "model.rotary_emb": compute[0], "model.norm": compute[-1],
               "lm_head": compute[-1]})
    return dm


def auto_placement(model, devices: list[str]) -> dict:
    """device_map="auto" with max_memory: each GPU may hold 75% of the weights, so the model must split.

    (At 60%, accelerate's balancing of an 8-layer Llama-3.1-8B-shaped model sent lm_head to disk.)
    """
    indices = []
    for d in devices:
        dev = torch.device(d)
        if dev.type != "cuda":
            raise ValueError(f"--device-map auto spreads over GPUs only; got {d!r} (use --device-map even for cpu/disk)")
        indices.append(dev.index or 0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    share = int(weights * MAX_MEMORY_SHARE)
    return {"device_map": "auto", "max_memory": {i: share for i in indices}}


def run_device_map(args, dtype: torch.dtype, folder: Path) -> dict:
    devices = args.devices.split(",") if args.devices else default_devices()
    reference_device = next(d for d in devices if d != "disk")
    model, folder = build_checkpoint(args.model, dtype, reference_device, folder)
    ids, mask = prompt_batch(model.config.vocab_size, args.batch, args.prompt_len, reference_device)
    single = {kind: greedy(model, ids, mask, new_cache(kind, model.config, args), args.new_tokens)
              for kind in CACHE_KINDS}
    if args.device_map == "auto":
        placement_kwargs = auto_placement(model, devices)
    else:
        placement_kwargs = {"device_map": even_device_map(model.config.num_hidden_layers, devices),
                            "offload_folder": str(folder / "offload")}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    model = load(folder, dtype, **placement_kwargs)
    device_map = {k: _device_name(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    used = sorted({device_map[k] for k in device_map if k.startswith("model.layers.")})
    runs, checks = {}, {}
    first = device_map.get("model.embed_tokens", reference_device)
    first = reference_device if first == "disk" else first
    for kind in CACHE_KINDS:
        cache = new_cache(kind, model.config, args)
        runs[kind] = greedy(model, ids.to(first), mask.to(first), cache, args.new_tokens)
        checks[kind] = compare_tokens(single[kind], runs[kind], args.tie_tolerance)
        if kind == "turboquant":
            layers = placement(model, cache)
    split_ok = len(used) == len(devices) if args.device_map == "auto" else True
    offloaded = sorted(k for k, v in device_map.items() if v in ("cpu", "disk") and args.device_map == "auto")
    compressed_on = sorted({r["layer_device"] for r in layers if r["kind"] == "compressed"})
    return {
        "mode": "device_map", "devices": devices, "device_map_kind": args.device_map, "device_map": device_map,
        "layer_devices_used": used, "split_over_all_devices": split_ok, "offloaded_by_auto": offloaded,
        "compressed_layers_on": compressed_on, "layers": layers,
        "kv_bytes_per_device": bytes_per_device(layers), "tokens": checks,
        "max_logit_diff": {k: float((runs[k]["logits"] - single[k]["logits"]).abs().max()) for k in CACHE_KINDS},
        "seconds": {k: {"single": single[k]["seconds"], "split": runs[k]["seconds"]} for k in CACHE_KINDS},
        "ok": split_ok and not offloaded and all(r["ok"] for r in layers) and all(c["ok"] for c in checks.values()),
    }


# ---- tensor-parallel mode ----------------------------------------------------------------------
def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world, this rank's device); NCCL on GPUs, gloo on CPU; started by torchrun."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise RuntimeError("--tp must be started by torchrun, e.g. torchrun --nproc-per-node 2 -m eval.multi_gpu --tp")
    local = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def run_tp(args, dtype: torch.dtype, folder: Path | None) -> dict | None:
    """Rank 0 generates on its device alone and writes the checkpoint; then every rank loads its shard."""
    import torch.distributed as dist

    rank, world, device = init_distributed()
    shared = [None, None]
    created = folder is None
    if rank == 0:
        folder = Path(folder or tempfile.mkdtemp(prefix="tq_hf_multi_gpu_"))
        model, checkpoint = build_checkpoint(args.model, dtype, device, folder)
        ids, mask = prompt_batch(model.config.vocab_size, args.batch, args.prompt_len, device)
        single = {}
        for kind in CACHE_KINDS:
            cache = new_cache(kind, model.config, args)
            single[kind] = greedy(model, ids, mask, cache, args.new_tokens)
            single[kind]["layers"] = placement(model, cache)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        shared = [str(checkpoint), str(folder)]
    dist.broadcast_object_list(shared, src=0)
    checkpoint, folder = Path(shared[0]), Path(shared[1])
    model = load(checkpoint, dtype, tp_plan="auto")
    ids, mask = prompt_batch(model.config.vocab_size, args.batch, args.prompt_len, device)
    mine = {}
    for kind in CACHE_KINDS:
        cache = new_cache(kind, model.config, args)
        run = greedy(model, ids, mask, cache, args.new_tokens)
        mine[kind] = {"tokens": run["tokens"], "logits": run["logits"] if rank == 0 else None,
                      "seconds": run["seconds"], "layers": placement(model, cache)}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    if created:
        shutil.rmtree(folder, ignore_errors=True)
    return tp_report(args, world, single, gathered, getattr(model, "tp_size", None) or world)


def tp_report(args, world: int, single: dict, ranks: list[dict], tp_size: int) -> dict:
    """Per rank: heads per compressed layer == total / world, KV bytes == single / world, tokens as single."""
    checks, per_rank = {}, []
    for kind in CACHE_KINDS:
        ref_layers = single[kind]["layers"]
        single_bytes = sum(r["kv_bytes"] for r in ref_layers)
        for rank, result in enumerate(ranks):
            heads_ok = all(r["kv_heads"] * world == s["kv_heads"] for r, s in zip(result[kind]["layers"], ref_layers))
            rank_bytes = sum(r["kv_bytes"] for r in result[kind]["layers"])
            tokens = compare_tokens(single[kind], result[kind], args.tie_tolerance)
            per_rank.append({
                "cache": kind, "rank": rank, "kv_heads": [r["kv_heads"] for r in result[kind]["layers"]],
                "single_kv_heads": [s["kv_heads"] for s in ref_layers], "heads_ok": heads_ok,
                "kv_bytes": rank_bytes, "single_kv_bytes": single_bytes,
                "kv_bytes_ratio": rank_bytes / single_bytes if single_bytes else None,
                "bytes_ok": rank_bytes * world == single_bytes,
                "placement_ok": all(r["ok"] for r in result[kind]["layers"]),
                "tokens": tokens, "seconds": result[kind]["seconds"], "single_seconds": single[kind]["seconds"],
            })
        checks[kind] = all(r["heads_ok"] and r["bytes_ok"] and r["placement_ok"] and r["tokens"]["ok"]
                           for r in per_rank if r["cache"] == kind)
    return {"mode": "tp", "world_size": world, "tp_size": tp_size, "ranks": per_rank,
            "ok": all(checks.values()) and tp_size == world}


# ---- output ------------------------------------------------------------------------------------
def _heads(per_layer: list[int]) -> str:
    return "/".join(str(h) for h in sorted(set(per_layer)))


def table(report: dict) -> str:
    if report["mode"] == "tp":
        rows = [[r["cache"], r["rank"], _heads(r["kv_heads"]) + f" (1 device: {_heads(r['single_kv_heads'])})",
                 f"{r['kv_bytes'] / 2**20:.2f} / {r['single_kv_bytes'] / 2**20:.2f} = {r['kv_bytes_ratio']:.3f}",
                 r["tokens"]["verdict"], "ok" if r["heads_ok"] and r["bytes_ok"] and r["placement_ok"] else "FAIL"]
                for r in report["ranks"]]
        return markdown_table(["cache", "rank", "KV heads/layer", "KV MiB rank / 1 device", "tokens vs 1 device",
                               "heads+bytes"], rows)
    rows = [[r["layer"], r["kind"], r["mapped_to"], r["layer_device"], ",".join(r["cache_devices"]), r["kv_heads"],
             f"{r['kv_bytes'] / 2**20:.2f}", "ok" if r["ok"] else "FAIL"] for r in report["layers"]]
    text = markdown_table(["layer", "cache layer", "device_map", "runs on", "cache tensors on", "KV heads", "KV MiB", "placement"],
                          rows)
    summary = [[k, c["verdict"], f"{report['max_logit_diff'][k]:.3g}"] for k, c in report["tokens"].items()]
    per_device = ", ".join(f"{d}: {b / 2**20:.2f} MiB" for d, b in report["kv_bytes_per_device"].items())
    return (text + "\n" + markdown_table(["cache", "tokens vs 1 device", "max |logit diff|"], summary) +
            f"\nlayers on {', '.join(report['layer_devices_used'])}; compressed layers on "
            f"{', '.join(report['compressed_layers_on']) or 'none'}; TurboQuant KV per device: {per_device}\n")


def write_markdown(path: Path, report: dict) -> None:
    """The run's table under its command, model and verdict."""
    mode = "tp_plan=\"auto\"" if report["mode"] == "tp" else "device_map=\"auto\""
    head = md_header(f"TurboQuantCache under {mode}", report["meta"]["command"],
                     f"devices: {report['meta']['machine']['cuda_device'] or 'CPU'}; model {report['model']} "
                     f"({report['dtype']}), preset {report['preset']}, batch {report['batch']}, "
                     f"{report['prompt_len']} prompt tokens, {report['new_tokens']} new tokens",
                     f"verdict: {'PASS' if report['ok'] else 'FAIL'}")
    path.write_text(head + "\n" + table(report), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    folder = Path(args.workdir) if args.workdir else None
    if args.tp:
        report = run_tp(args, dtype, folder)
        if report is None:  # not rank 0
            return 0
    else:
        workdir = folder or Path(tempfile.mkdtemp(prefix="tq_hf_multi_gpu_"))
        try:
            report = run_device_map(args, dtype, workdir)
        finally:
            if folder is None:
                shutil.rmtree(workdir, ignore_errors=True)
    report = {"meta": run_metadata("eval.multi_gpu", argv), "model": args.model, "dtype": args.dtype,
              "preset": args.preset, "batch": args.batch, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, **report}
    print(table(report))
    print("PASS" if report["ok"] else "FAIL")
    write_json(Path(args.out) / f"{report['mode']}.json", report)
    write_markdown(Path(args.out) / f"{report['mode']}.md", report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
