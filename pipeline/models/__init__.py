"""Model helpers shared by serving and training (no hub access at run time)."""

from pipeline.models.tiny import build_model, build_tokenizer, default_model_dir, ensure_tiny_model

__all__ = ["build_model", "build_tokenizer", "default_model_dir", "ensure_tiny_model"]
