"""tq_hf: TurboQuant KV-cache compression for HuggingFace transformers.

Importing the package registers the "turboquant" attention and mask functions with
transformers, so `attn_implementation="turboquant"` works after `import tq_hf`, and the
"turboquant" cache implementation of generate() (`cache_implementation="turboquant"`), whose compiled
forward runs a TurboQuantCache's settling forwards (a batch's first prefill chunk) eagerly.
"""

from .attention import register
from .cache import TurboQuantCache, TurboQuantCacheFullError
from .config import PRESETS, TurboQuantConfig
from .generation import register_cache_implementation, register_compiled_call
from .support import register_load_check

register()
register_cache_implementation()
register_compiled_call()
register_load_check()

__all__ = ["PRESETS", "TurboQuantCache", "TurboQuantCacheFullError", "TurboQuantConfig"]
