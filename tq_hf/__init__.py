"""tq_hf: TurboQuant KV-cache compression for HuggingFace transformers.

Importing the package registers the "turboquant" attention and mask functions with
transformers, so `attn_implementation="turboquant"` works after `import tq_hf`.
"""

from .config import PRESETS, TurboQuantConfig

__all__ = ["PRESETS", "TurboQuantConfig"]

try:  # the cache and attention glue land in their own modules
    from .cache import TurboQuantCache  # noqa: F401
    from .attention import register  # noqa: F401

    register()
    __all__ += ["TurboQuantCache"]
except ImportError as exc:  # pragma: no cover - only while those modules are being written
    if "tq_hf.cache" not in str(exc) and "tq_hf.attention" not in str(exc) and "cannot import name" not in str(exc):
        raise
