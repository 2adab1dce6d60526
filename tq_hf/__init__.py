"""tq_hf: TurboQuant KV-cache compression for HuggingFace transformers.

Importing the package registers the "turboquant" attention and mask functions with
transformers, so `attn_implementation="turboquant"` works after `import tq_hf`.
"""

from .attention import register
from .cache import TurboQuantCache, TurboQuantCacheFullError
from .config import PRESETS, TurboQuantConfig

register()

__all__ = ["PRESETS", "TurboQuantCache", "TurboQuantCacheFullError", "TurboQuantConfig"]
