"""What the renderer tests share: a byte-level BPE tokenizer with a family's special tokens."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


def build_bpe_tokenizer(special_tokens, corpus, vocab_size, chat_template=None):
    """A byte-level BPE tokenizer trained on `corpus` (BpeTrainer, `vocab_size`), `special_tokens` as
    single special tokens, so that merges across text boundaries happen as in a family's tokenizer."""
    special_tokens = list(special_tokens)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
