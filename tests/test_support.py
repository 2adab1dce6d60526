"""Models a TurboQuantCache cannot serve fail at load or at the cache's construction, with the reason."""

from __future__ import annotations

import pytest
import torch
from models import FAMILIES, tiny_model, with_cache
from transformers import AutoConfig, AutoModelForCausalLM

from tq_hf import TurboQuantCache
from tq_hf.support import unsupported_reason

SMALL = dict(vocab_size=96, num_hidden_layers=2, num_attention_heads=4, hidden_size=128)
OWN_ATTENTION = {  # model types whose attention code does not go through transformers' attention interface
    "falcon": dict(SMALL),
    "gpt_neo": dict(vocab_size=96, hidden_size=128, num_layers=2, num_heads=4, attention_types=[[["global"], 2]]),
    "bloom": dict(vocab_size=96, hidden_size=128, n_layer=2, n_head=4),
    "mpt": dict(vocab_size=96, d_model=128, n_layers=2, n_heads=4),
    "xglm": dict(vocab_size=96, d_model=128, num_layers=2, attention_heads=4, ffn_dim=128),
}
MLA = {
    "deepseek_v2": dict(SMALL, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                        qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1),
    "deepseek_v3": dict(SMALL, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                        qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1, n_group=1, topk_group=1),
}


@pytest.mark.parametrize("model_type", sorted(OWN_ATTENTION))
def test_own_attention_models_fail_at_load_and_at_the_cache(model_type):
    config = AutoConfig.for_model(model_type, **OWN_ATTENTION[model_type])
    with pytest.raises(ValueError, match=rf"model type '{model_type}' .* computes attention in its own code"):
        AutoModelForCausalLM.from_config(config, attn_implementation="turboquant")
    with pytest.raises(ValueError, match=rf"model type '{model_type}'.*supported: models that take"):
        TurboQuantCache(config)


@pytest.mark.parametrize("model_type", sorted(MLA))
@pytest.mark.parametrize("attn", ["turboquant", "sdpa"])
def test_latent_attention_is_refused_never_quantized(model_type, attn):
    config = AutoConfig.for_model(model_type, **MLA[model_type])
    match = rf"model type '{model_type}' uses multi-head latent attention \(MLA\)"
    if attn == "turboquant":
        with pytest.raises(ValueError, match=match):
            AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=match):
        TurboQuantCache(model.config)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_interface_families_are_supported(family):
    model = tiny_model(family)
    assert unsupported_reason(model.config) is None
    cache = TurboQuantCache(model.config, preset="k8v4")
    with torch.no_grad():
        model(input_ids=torch.tensor([[4, 5, 6]]), use_cache=True, **with_cache(cache))
    assert cache.get_seq_length() == 3


def test_unknown_configs_are_not_refused():
    """Configs transformers does not map to a class (custom code, bare namespaces) are judged at use."""
    from types import SimpleNamespace

    assert unsupported_reason(SimpleNamespace(model_type="my_custom_lm")) is None
