"""mlx-lm's ``ModelProvider`` loading with ``mlx_streaming.load``.
"""

import gc
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.processors import load_processor

from ..errors import ConfigError
from ..mlx_lm_adapter import ModelProvider
from ..runtime.loader import load, sharded_load


class StreamingModelProvider(ModelProvider):
    """Serves the one stream directory (or repo) of ``--model``, loaded with
    ``config``; requests may name it by its directory name or path."""

    def __init__(self, cli_args, config):
        super().__init__(cli_args)
        self.config = config
        served = cli_args.model
        for name in (Path(served).name, str(served)):
            self.alias(name, served)  # the same model, never a reload

    def load_model(self, model_path, adapter_path, draft_model_path) -> None:
        if model_path != self.cli_args.model or adapter_path or draft_model_path:
            raise ConfigError(f"this server serves only {self.cli_args.model}, without "
                              "adapters or draft models")
        self.reset()
        gc.collect()
        mx.clear_cache()
        options = dict(tokenizer_config=self.tokenizer_config, return_config=True,
                       trust_remote_code=self.cli_args.trust_remote_code, config=self.config)
        if self.is_distributed:  # under mlx.launch: every rank streams its share
            model, tokenizer, model_config = sharded_load(
                model_path, self.pipeline_group, self.tensor_group, **options)
        else:
            model, tokenizer, model_config = load(model_path, **options)
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model, self.tokenizer = model, tokenizer
        self.processor = load_processor(model, model_config)
        self.draft_model = None
        # mlx-lm's rule: requests are decoded together where every
        # cache of the model can merge; not with drafts (one at a time).
        self.is_batchable = (not self.cli_args.draft and self.cli_args.decode_concurrency > 1
                             and all(hasattr(c, "merge") for c in make_prompt_cache(model)))


def make_provider(mlx_args, config) -> StreamingModelProvider:
    """mlx-lm's ``ModelProvider`` loading with ``mlx_streaming.load``."""
    return StreamingModelProvider(mlx_args, config)
