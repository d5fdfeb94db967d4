"""zerotrain data path: tokenizers, weighted source mixes, the packed-sequence collator.

Four layers, each importing only itself and the layers listed before it (tests/test_architecture.py holds the map):
    format     errors, docstore (documents as index arrays), mix (the mix spec), sft (chat and
               prompt/completion records as tokens)
    sources    readers (local files), streamed (record streams), hub (Hub datasets and tokenizers),
               tokenizer, shards (prepared token shards), tokenfile (flat token files)
    pipeline   packing, pieces, holdout (eval rows), loader (a run's batches), reshard
    commands   `zerotrain data ...`
"""
