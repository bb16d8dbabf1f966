"""Native models. `build_model(cfg.model)` turns a conf/model yaml into a Llama."""

from xffl_like.models.llama import Llama, LlamaConfig, TransformerBlock, build_model, count_parameters

__all__ = ["Llama", "LlamaConfig", "TransformerBlock", "build_model", "count_parameters"]
