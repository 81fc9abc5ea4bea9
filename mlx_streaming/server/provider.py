"""mlx-lm's ``ModelProvider`` loading with ``mlx_streaming.load``.
"""

import argparse
from pathlib import Path
from ..errors import ConfigError


def make_provider(mlx_args: argparse.Namespace, config):
    """mlx-lm's ``ModelProvider`` loading with ``mlx_streaming.load``."""
    import gc

    import mlx.core as mx
    import mlx_lm.server as mlx_server
    from mlx_lm.models.cache import make_prompt_cache

    from ..runtime.loader import load, sharded_load

    class StreamingModelProvider(mlx_server.ModelProvider):
        def __init__(self, cli_args):
            super().__init__(cli_args)
            # Requests may name the model by its directory name or path:
            # the same model, never a reload.
            served = cli_args.model
            for name in (Path(served).name, str(served)):
                self._model_map[name] = served
                self._adapter_map[name] = None
                self._draft_model_map[name] = None

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            if model_path != self.cli_args.model or adapter_path or draft_model_path:
                raise ConfigError(f"this server serves only {self.cli_args.model}, without "
                                  "adapters or draft models")
            self.reset()
            gc.collect()
            mx.clear_cache()
            if self.is_distributed:  # under mlx.launch: every rank streams its share
                model, tokenizer, model_config = sharded_load(
                    model_path, self.pipeline_group, self.tensor_group, return_config=True,
                    tokenizer_config=self._tokenizer_config,
                    trust_remote_code=self.cli_args.trust_remote_code, config=config)
            else:
                model, tokenizer, model_config = load(
                    model_path, tokenizer_config=self._tokenizer_config, return_config=True,
                    trust_remote_code=self.cli_args.trust_remote_code, config=config)
            if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
                tokenizer.chat_template = tokenizer.default_chat_template
            self.model_key = (model_path, adapter_path, draft_model_path)
            self.model, self.tokenizer = model, tokenizer
            self.processor = mlx_server.load_processor(model, model_config)
            self.draft_model = None
            # mlx-lm's rule: requests are decoded together where every
            # cache of the model can merge; not with drafts (one at a time).
            self.is_batchable = (not self.cli_args.draft and self.cli_args.decode_concurrency > 1
                                 and all(hasattr(c, "merge") for c in make_prompt_cache(model)))

    return StreamingModelProvider(mlx_args)
