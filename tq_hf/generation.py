"""`generate(cache_implementation="turboquant", cache_config={...})`: TurboQuant turned on once.

transformers builds the cache of a generate() call from `generation_config.cache_implementation`
but offers no registry for third-party caches, so importing tq_hf extends the two places that
decide: the list of valid names (GenerationConfig.validate reads it) and the method that builds
the cache (`_prepare_cache_for_generation`). A model loaded with `attn_implementation="turboquant"`
also gets a TurboQuantCache when the call names no cache, since that attention exists to read one.

generate()'s compiled forward (`get_compiled_call`, which it uses for a compileable cache's decode
steps and prefill chunks) runs a forward uncompiled where a TurboQuantCache settles state on the host
(a batch's first chunk, chunks while the key-centering means settle): compiled, that forward broke
the graph in every layer, and dynamo then compiled each layer apart up to its recompile limit.
Everything else of generate() is untouched.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect

from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin
from transformers.modeling_utils import PreTrainedModel

from .cache import ATTENTION_NAME, TurboQuantCache
from .config import PRESETS, TurboQuantConfig

CACHE_IMPLEMENTATION = "turboquant"
CACHE_KEYS = ("cache", "past_key_values")  # where generate() keeps the cache: 5.24+, then older 5.x


def cache_from_options(model_config, options: dict | None = None) -> TurboQuantCache:
    """A TurboQuantCache for `model_config` from a generation config's `cache_config` dict.

    Keys: "preset" (default "4bit"), any TurboQuantConfig field (overrides the preset's), or
    "tq_config" (a TurboQuantConfig), and TurboQuantCache's own arguments (e.g. max_cache_tokens).
    """
    options = dict(options or {})
    cache_args = [p for p in inspect.signature(TurboQuantCache.__init__).parameters
                  if p not in ("self", "config", "preset", "tq_config")]
    fields = [f.name for f in dataclasses.fields(TurboQuantConfig)]
    unknown = sorted(set(options) - set(cache_args) - set(fields) - {"preset", "tq_config"})
    if unknown:
        raise ValueError(f"unknown cache_config keys for cache_implementation='{CACHE_IMPLEMENTATION}': {unknown}; "
                         f"supported: 'preset' ({', '.join(PRESETS)}), 'tq_config', TurboQuantConfig fields "
                         f"({', '.join(fields)}) and {', '.join(cache_args)}")
    tq_config = options.pop("tq_config", None)
    overrides = {k: options.pop(k) for k in fields if k in options}
    preset = options.pop("preset", None)
    if tq_config is not None:
        if preset is not None or overrides:
            raise ValueError("cache_config: pass 'tq_config' alone, or 'preset' with TurboQuantConfig fields")
        return TurboQuantCache(model_config, tq_config=tq_config, **options)
    if overrides:
        return TurboQuantCache(model_config, tq_config=TurboQuantConfig.from_preset(preset or "4bit", **overrides),
                               **options)
    return TurboQuantCache(model_config, preset=preset, **options)


def _user_cache(model_kwargs: dict) -> Cache | None:
    return next((model_kwargs[k] for k in CACHE_KEYS if model_kwargs.get(k) is not None), None)


def _wants_turboquant(model, generation_config, model_kwargs: dict) -> bool:
    if generation_config.cache_implementation == CACHE_IMPLEMENTATION:
        return True
    attention = getattr(model.config, "_attn_implementation", None)
    return (generation_config.cache_implementation is None and attention == ATTENTION_NAME
            and _user_cache(model_kwargs) is None)


def _prepare_cache(original):
    @functools.wraps(original)
    def prepare(self, generation_config, model_kwargs, *args, **kwargs):
        if not _wants_turboquant(self, generation_config, model_kwargs):
            return original(self, generation_config, model_kwargs, *args, **kwargs)
        if generation_config.cache_implementation == CACHE_IMPLEMENTATION and _user_cache(model_kwargs) is not None:
            raise ValueError(f"Passing both cache_implementation='{CACHE_IMPLEMENTATION}' and a cache object is "
                             "unsupported. Please use only one of the two.")
        # transformers' own escapes (use_cache=False, models without Cache support) and the key the
        # model takes its cache under: let it build its default cache, then replace that cache
        plain = copy.copy(generation_config)
        plain.cache_implementation = None
        result = original(self, plain, model_kwargs, *args, **kwargs)
        for key in CACHE_KEYS:
            built = model_kwargs.get(key)
            if type(built) is DynamicCache:
                model_kwargs[key] = cache = cache_from_options(self.config, generation_config.cache_config)
                if getattr(generation_config, "is_assistant", False):  # generate() crops an assistant's cache
                    cache.activate_past_recording()
            elif isinstance(built, Cache) and generation_config.cache_implementation == CACHE_IMPLEMENTATION:
                raise ValueError(f"cache_implementation='{CACHE_IMPLEMENTATION}' supports decoder-only models; "
                                 f"{type(self).__name__} takes a {type(built).__name__}")
        return result

    prepare._turboquant = True
    return prepare


def register_cache_implementation() -> None:
    """Make `cache_implementation="turboquant"` valid in generate() and GenerationConfig (idempotent)."""
    if CACHE_IMPLEMENTATION not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS:
        configuration_utils.ALL_CACHE_IMPLEMENTATIONS = (*configuration_utils.ALL_CACHE_IMPLEMENTATIONS,
                                                         CACHE_IMPLEMENTATION)
    method = GenerationMixin._prepare_cache_for_generation
    if not getattr(method, "_turboquant", False):
        GenerationMixin._prepare_cache_for_generation = _prepare_cache(method)


def _new_tokens(kwargs: dict) -> int:
    """Tokens per row of a forward's input_ids [B, L] or inputs_embeds [B, L, D] (2, as several, when neither)."""
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    return inputs.shape[1] if inputs is not None and inputs.dim() >= 2 else 2


def _eager_while_settling(model, compiled, *args, **kwargs):
    """The compiled forward, or the model's own where a TurboQuantCache settles state on the host in this forward
    (TurboQuantCache.settles_on_host): such a forward runs once or a few times per batch, and uncompiled it
    allocates every persistent buffer outside any CUDA graph."""
    cache = _user_cache(kwargs)
    if isinstance(cache, TurboQuantCache) and cache.settles_on_host(_new_tokens(kwargs)):
        return model(*args, **kwargs)
    return compiled(*args, **kwargs)


def _compiled_call(original):
    @functools.wraps(original)
    def get_compiled_call(self, compile_config):
        return functools.partial(_eager_while_settling, self, original(self, compile_config))

    get_compiled_call._turboquant = True
    return get_compiled_call


def register_compiled_call() -> None:
    """Make generate()'s compiled forward run a TurboQuantCache's settling forwards eagerly (idempotent)."""
    method = PreTrainedModel.get_compiled_call
    if not getattr(method, "_turboquant", False):
        PreTrainedModel.get_compiled_call = _compiled_call(method)
