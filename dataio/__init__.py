"""zerotrain data path: tokenizers, weighted source mixes, the packed-sequence collator."""
