"""Which transformers models a TurboQuantCache can serve, said before anything runs.

The cache works through transformers' attention interface: the model hands `update()` per-layer
key/value tensors [batch, KV heads, tokens, head_dim] and calls the registered attention function.
Models that compute attention in their own code (falcon, gpt_neo, bloom, mpt, xglm, ...) or cache a
compressed latent instead of per-head K/V (multi-head latent attention: DeepSeek-V2/V3 and kin)
would otherwise fail deep inside their forward, or quantize the latent as if it were K/V heads.
"""

from __future__ import annotations

import transformers

ATTENTION_NAME = "turboquant"  # the attn_implementation that reads the compressed pool directly
MLA_ATTRIBUTE = "kv_lora_rank"  # configs of multi-head latent attention models carry the latent's rank


def _causal_lm_class(model_type: str | None):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type or "")
    return getattr(transformers, name, None) if isinstance(name, str) else None


def unsupported_reason(config, model_class: type | None = None) -> str | None:
    """Why a TurboQuantCache cannot serve the model of `config` (None: it can)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    if getattr(text, MLA_ATTRIBUTE, None):
        return (f"model type {model_type!r} uses multi-head latent attention (MLA): its cache holds a compressed "
                "latent, not per-head keys and values, and TurboQuantCache does not support it")
    cls = model_class or _causal_lm_class(model_type)
    if cls is not None and not getattr(cls, "_supports_attention_backend", True):
        return (f"model type {model_type!r} ({cls.__name__}) computes attention in its own code, outside "
                "transformers' attention interface, which TurboQuantCache and attn_implementation="
                f"'{ATTENTION_NAME}' need; supported: models that take attn_implementation='sdpa' through that "
                "interface (llama, mistral, qwen2/3, gemma 1-3, phi3, gpt_oss, olmo2, granite, ...)")
    return None


def check_supported(config, model_class: type | None = None) -> None:
    """Raise ValueError naming the model type when a TurboQuantCache cannot serve it."""
    reason = unsupported_reason(config, model_class)
    if reason:
        raise ValueError(reason)


def _checked_attention(original):
    def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
        if requested_attention == ATTENTION_NAME:
            check_supported(self.config, type(self))
        return original(self, requested_attention, *args, **kwargs)

    get_correct_attn_implementation._turboquant = True
    return get_correct_attn_implementation


def register_load_check() -> None:
    """attn_implementation="turboquant" on an unsupported model fails at load with the reason (idempotent).

    transformers checks sdpa and flash attention the same way, in get_correct_attn_implementation."""
    from transformers import PreTrainedModel

    method = PreTrainedModel.get_correct_attn_implementation
    if not getattr(method, "_turboquant", False):
        PreTrainedModel.get_correct_attn_implementation = _checked_attention(method)
