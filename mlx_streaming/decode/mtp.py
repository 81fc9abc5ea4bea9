"""Drafts from the model's own MTP layers (``models.mtp_layers``)."""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..errors import ConfigError

PREFILL_STEP = 512


class MtpDraft:
    """Drafts from the model's own MTP layer: position ``i`` takes the target's
    hidden state at ``i`` and token ``i + 1``, and predicts token ``i + 2``."""

    name = "mtp"
    needs_hidden = True

    def __init__(self, model):
        mtp = getattr(model, "mtp", None)
        if not mtp:
            raise ConfigError(
                "this model has no MTP layers loaded: load it with mtp=True (generate "
                "--draft mtp) from a stream directory converted with its MTP weights")
        self.model = model
        self.layer = mtp[0]
        self.runtime = model.streaming
        self.cache = None
        self.pairs: Tuple[List[int], Optional[mx.array]] = ([], None)
        self.speculative = 0  # entries of the MTP cache fed with its own guesses
        self.proposed = False

    def start(self, prompt: Sequence[int], hidden: Optional[mx.array]) -> None:
        """``hidden``: the target's states at ``prompt[:-1]`` (None: one token)."""
        # The family's own cache type for its last layer (MLA, sparse ...).
        self.cache = make_prompt_cache(self.model)[-1]
        self.pairs = (list(prompt[1:]), hidden)
        self.speculative = 0
        self.proposed = False

    def _step(self, tokens: List[int], hidden: mx.array) -> mx.array:
        with self.runtime.call():
            embeds = self.model.model.embed_tokens(mx.array(tokens)[None])
            try:
                h = self.layer(embeds, hidden[None], self.cache)[0]
            except (ValueError, TypeError, AttributeError) as e:
                # Families whose layers want masks or caches shaped their own way.
                raise ConfigError(
                    f"MTP drafting does not support {getattr(self.model.args, 'model_type', 'this model')}'s layers yet "
                    f"({type(e).__name__}: {str(e)[:120]}); use --draft ngram (or, with "
                    "generate, --draft-model)") from None
            logits = self.model.lm_head(self.layer.shared_head.norm(h[-1:]))
        return h, logits

    def propose(self, k: int) -> Tuple[List[int], Optional[np.ndarray]]:
        tokens, hidden = self.pairs
        if not tokens:  # a one-token prompt: no pair yet
            return [], None
        self.proposed = True
        # A long prompt's pairs go in chunks, as the target's prefill does.
        for i in range(0, len(tokens), PREFILL_STEP):
            h, logits = self._step(tokens[i:i + PREFILL_STEP], hidden[i:i + PREFILL_STEP])
        drafts = [int(mx.argmax(logits[-1]).item())]
        for _ in range(k - 1):
            h, logits = self._step(drafts[-1:], h[-1:])
            drafts.append(int(mx.argmax(logits[-1]).item()))
        self.speculative = k - 1
        return drafts[:k], None

    def commit(self, drafts: List[int], n: int, nxt: int, hidden: mx.array) -> None:
        """``hidden``: the target's states at the call's kept tokens (y, accepted)."""
        if self.speculative:
            self.cache.trim(self.speculative)
            self.speculative = 0
        tokens = [*drafts[:n], nxt]
        if not self.proposed and self.pairs[1] is not None:
            # The pending pairs never reached the MTP layer.
            tokens = self.pairs[0] + tokens
            hidden = mx.concatenate([self.pairs[1], hidden], axis=0)
        self.pairs = (tokens, hidden)
        self.proposed = False
